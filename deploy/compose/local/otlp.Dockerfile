# Stand-in for otel/opentelemetry-collector and jaegertracing/jaeger where no image registry is
# reachable (neither Debian, PyPI nor npm ships either): Rotel, an OTLP collector in Rust, from the PyPI
# wheel rotel==0.0.1a15 (rotel/rotel-agent). It really receives OTLP (gRPC 4317, HTTP 4318), and
# EXPORTER picks what it does with the spans: `otlp` forwards them to EXPORT_TO (the collector's role),
# `blackhole` drops them after logging each span (the trace store's role; `docker compose logs jaeger`).
# It does not read the collector's config file nor serve Jaeger's UI: a stack built with it proves
# that spans leave the router and arrive over OTLP, not that deploy/compose/otel-collector.yaml is right.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
ARG EXPORTER=blackhole
ARG EXPORT_TO=
COPY rotel-agent otlp-standin /usr/local/bin/
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin otlp
ENV NO_COLOR=1 \
    ROTEL_OTLP_GRPC_ENDPOINT=0.0.0.0:4317 \
    ROTEL_OTLP_HTTP_ENDPOINT=0.0.0.0:4318 \
    ROTEL_DEBUG_LOG=traces \
    ROTEL_DEBUG_LOG_VERBOSITY=detailed \
    ROTEL_EXPORTER=${EXPORTER} \
    ROTEL_OTLP_EXPORTER_ENDPOINT=${EXPORT_TO}
USER 10001
EXPOSE 4317 4318
ENTRYPOINT ["/usr/local/bin/otlp-standin"]
