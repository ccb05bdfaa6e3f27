# Stand-in for valkey/valkey where no image registry is reachable: Debian bookworm has no Valkey
# package, so this is its `redis-server` (Redis 7.0, the protocol Valkey speaks). Routers only use
# PUBLISH/SUBSCRIBE, so nothing is persisted.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/*
USER redis
EXPOSE 6379
CMD ["redis-server", "--bind", "0.0.0.0", "--protected-mode", "no", "--save", "", "--appendonly", "no"]
