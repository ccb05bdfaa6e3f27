"""Real SGLang 0.5.23 on this machine's CPU: where the ``make sglang-cpu`` install lives, and whether it is complete.

``make sglang-cpu`` (``sglang_workers.real.install``) puts three things in one per-user directory
keyed by the SGLang version, ``${XDG_CACHE_HOME:-~/.cache}/prefix-router/sglang-0.5.23`` (or
``$PREFIX_ROUTER_SGLANG_CPU``): a virtualenv with ``sglang==0.5.23`` (its own pins, apart from the
project's ``.venv``), a ``libcuda.so.1`` stand-in built from ``cpu/libcuda_stub.c`` (the CUDA-built
``sgl_kernel`` wheel needs the driver library to import; nothing calls it on the CPU path), and a tiny
random-weight Llama built from the project's default tokenizer (``cpu/build_tiny_model.py``).

This module finds that install (``find_install``) or says what is missing (``missing_install_reason``);
``cpu_launch`` runs workers from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from prefix_common.tokenization import DEFAULT_TOKENIZER_DIR

__all__ = [
    "CPU_DIR",
    "PD_DEBIAN_PACKAGES",
    "PD_LIBRARIES",
    "PD_PIP_PACKAGES",
    "SGLANG_CPU_VERSION",
    "TINY_MODEL_NAME",
    "TINY_MODEL_VOCAB",
    "CpuInstall",
    "default_install_dir",
    "find_install",
    "ldconfig_listing",
    "missing_install_reason",
    "missing_pd_packages",
    "model_digest",
    "stub_digest",
]

SGLANG_CPU_VERSION = "0.5.23"  # the release the simulator reproduces and these workers run
CPU_DIR = Path(__file__).resolve().parent / "cpu"  # the stub's C source and the model builder
TINY_MODEL_NAME = "tiny-llama"  # --served-model-name of the CPU workers
TINY_MODEL_VOCAB = 8192  # the default tokenizer's vocabulary (largest id 8191) = the model's
# What a real prefill/decode pair needs besides SGLang: Mooncake's transfer engine (TCP; the non-CUDA build) and
# msgpack in SGLang's venv, and the RDMA libraries Mooncake's engine.so links against (even when it uses TCP).
PD_PIP_PACKAGES = ("mooncake-transfer-engine-non-cuda==0.3.13.post1", "msgpack")
# The shared libraries Mooncake's engine.so links (soname -> the Debian package that ships it).
PD_LIBRARIES = {
    "libibverbs.so.1": "libibverbs1",
    "libnl-3.so.200": "libnl-3-200",
    "libnl-route-3.so.200": "libnl-route-3-200",
}
PD_DEBIAN_PACKAGES = tuple(PD_LIBRARIES.values())
STAMP = "prefix-router-sglang-cpu.json"  # what was built, from which sources


def default_install_dir() -> Path:
    """``$PREFIX_ROUTER_SGLANG_CPU``, else ``${XDG_CACHE_HOME:-~/.cache}/prefix-router/sglang-<version>``."""
    override = os.environ.get("PREFIX_ROUTER_SGLANG_CPU")
    if override:
        return Path(override).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "prefix-router" / f"sglang-{SGLANG_CPU_VERSION}"


def ldconfig_listing() -> str:
    """``ldconfig -p``: every library the dynamic linker's cache knows; empty when ldconfig cannot be run."""
    binary = shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.access(p, os.X_OK)), None
    )
    if binary is None:
        return ""
    try:
        return subprocess.run([binary, "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def missing_pd_packages(listing: str) -> list[str]:
    """The Debian packages of ``PD_LIBRARIES`` absent from ``listing`` (``ldconfig -p`` output), in order.

    An empty listing (no ldconfig) says nothing either way: then nothing is reported missing, and the import
    check of Mooncake's engine (``make sglang-cpu``) still catches a missing library.
    """
    if not listing.strip():
        return []
    present = {line.split(maxsplit=1)[0] for line in listing.splitlines()[1:] if line.strip()}
    return [package for soname, package in PD_LIBRARIES.items() if soname not in present]


def _digest(*paths: Path) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def stub_digest() -> str:
    """Identity of the stand-in's source: a changed source means a rebuild."""
    return _digest(CPU_DIR / "libcuda_stub.c")


def model_digest(tokenizer_dir: Path = DEFAULT_TOKENIZER_DIR) -> str:
    """Identity of the tiny model: the builder and the tokenizer it copies (a new tokenizer means a rebuild)."""
    files = sorted(p for p in tokenizer_dir.iterdir() if p.is_file())
    return _digest(CPU_DIR / "build_tiny_model.py", *files)


@dataclass(frozen=True)
class CpuInstall:
    """The pieces of one ``make sglang-cpu`` install."""

    root: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def libcuda_dir(self) -> Path:
        return self.root / "prefix-router" / "libcuda"

    @property
    def model_dir(self) -> Path:
        return self.root / "prefix-router" / TINY_MODEL_NAME

    @property
    def stamp_path(self) -> Path:
        return self.root / "prefix-router" / STAMP

    def stamp(self) -> dict[str, str]:
        try:
            data = json.loads(self.stamp_path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def pd_problems(self, listing: str | None = None) -> list[str]:
        """What a PD pair still lacks (system libraries, the ``make sglang-cpu`` step that adds Mooncake); empty
        when it can run. ``listing``: ``ldconfig -p`` output, read now when not given."""
        packages = missing_pd_packages(ldconfig_listing() if listing is None else listing)
        if packages:
            return [
                f"Mooncake's transfer engine needs the Debian packages {' '.join(packages)}: as root, "
                f"apt-get install {' '.join(packages)}"
            ]
        if self.stamp().get("pd") == ",".join(PD_PIP_PACKAGES):
            return []
        name, version = PD_PIP_PACKAGES[0].split("==")
        probe = subprocess.run(  # another checkout's installer may have rewritten the stamp: ask the venv
            [str(self.python), "-c", f"import importlib.metadata as m; print(m.version({name!r})); import msgpack"],
            capture_output=True,
            text=True,
        )
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return []
        return [f"{' and '.join(PD_PIP_PACKAGES)} are not installed in {self.root}: run `make sglang-cpu`"]

    def problems(self) -> list[str]:
        """What is missing or out of date; empty when the install is complete and current."""
        stamp = self.stamp()
        out = []
        if not self.python.exists():
            out.append(f"no virtualenv at {self.root}")
        elif stamp.get("sglang") != SGLANG_CPU_VERSION:
            out.append(f"sglang=={SGLANG_CPU_VERSION} is not recorded as installed in {self.root}")
        if not (self.libcuda_dir / "libcuda.so.1").exists() or stamp.get("libcuda") != stub_digest():
            out.append("the libcuda.so.1 stand-in is missing or older than its source")
        if not (self.model_dir / "config.json").exists() or stamp.get("model") != model_digest():
            out.append("the tiny Llama is missing or was built from another tokenizer")
        return out


def find_install(root: Path | None = None) -> CpuInstall | None:
    """The complete, current install (at ``root`` or the default place), or None."""
    install = CpuInstall(root or default_install_dir())
    return install if not install.problems() else None


def missing_install_reason(root: Path | None = None) -> str | None:
    """Why real SGLang cannot run here (naming ``make sglang-cpu``), or None when it can."""
    install = CpuInstall(root or default_install_dir())
    problems = install.problems()
    if not problems:
        return None
    return f"real SGLang {SGLANG_CPU_VERSION} on CPU is not installed ({'; '.join(problems)}): run `make sglang-cpu`"
