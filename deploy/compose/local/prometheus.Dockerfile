# Stand-in for prom/prometheus where no image registry is reachable: Debian bookworm's `prometheus`
# package (2.42), run like the official image (entrypoint the binary, data under /prometheus).
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /prometheus \
    # Debian's build defaults --storage.tsdb.path to /var/lib/prometheus/metrics2: both must be writable.
    && chown -R nobody:nogroup /prometheus /var/lib/prometheus
USER nobody
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
