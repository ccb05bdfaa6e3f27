"""``make sglang-cpu``: install real SGLang 0.5.23 for this machine's CPU, or reuse the install already there.

Three steps, each skipped when its result is present and current (``sglang_workers.real.installation`` says
where everything lives):

1. a virtualenv with ``sglang==0.5.23`` (pip, ~4 min and ~11 GB on a fresh machine; the project's
   ``.venv`` is untouched: the two do not share pins);
2. ``libcuda.so.1``, built from ``cpu/libcuda_stub.c`` with the C compiler (well under a second);
3. the tiny random-weight Llama, built by ``cpu/build_tiny_model.py`` under the SGLang venv's Python
   from the project's default tokenizer (a few seconds; nothing is downloaded).

Then one import check (``sglang`` and ``sgl_kernel`` with the stand-in on the library path), and the install
is recorded as complete: aggregated workers can run.

4. what a prefill/decode pair needs besides: Mooncake's ``engine.so`` links the Debian packages
   ``PD_DEBIAN_PACKAGES`` (libibverbs and libnl), installed with apt-get when this runs as root (as ``.ci/run``
   does) unless ``--no-apt``; then ``PD_PIP_PACKAGES`` (Mooncake's non-CUDA transfer engine and msgpack) in the
   venv, added to an existing install too, and a check that Mooncake's engine loads. Only PD pairs need this
   step, so when it cannot be done (not root, no apt-get, no wheel for this platform) the aggregated install
   stands and one line says what PD still needs.

Whatever else is missing (a C compiler, disk space, a Python for the venv) stops the install, reported in one
line with the fix.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from prefix_common.tokenization import DEFAULT_TOKENIZER_DIR

from .cpu_launch import cpu_environment
from .installation import (
    CPU_DIR,
    PD_DEBIAN_PACKAGES,
    PD_PIP_PACKAGES,
    SGLANG_CPU_VERSION,
    CpuInstall,
    default_install_dir,
    ldconfig_listing,
    missing_pd_packages,
    model_digest,
    stub_digest,
)

__all__ = ["InstallError", "install", "main"]

INSTALL_GB = 11  # what `pip install sglang==0.5.23` leaves on disk (torch arrives as the CUDA build)
NEEDED_GB = 12  # free space asked for before pip starts: the install plus room for unpacking


class InstallError(RuntimeError):
    """A missing prerequisite or a failed step: the message says what to do."""


def _say(message: str) -> None:
    print(f"sglang-cpu: {message}", flush=True)


def find_compiler() -> str:
    """The C compiler (``$CC``, ``cc`` or ``gcc``); a clear error naming the Debian package otherwise."""
    for candidate in (os.environ.get("CC"), "cc", "gcc"):
        if candidate and shutil.which(candidate):
            return candidate
    raise InstallError(
        "no C compiler found (tried $CC, cc, gcc); one is needed to build the libcuda.so.1 stand-in. "
        "On Debian or Ubuntu: apt-get install gcc"
    )


def installed_sglang(install: CpuInstall) -> str | None:
    """The sglang version in the venv, or None (no venv, no sglang)."""
    if not install.python.exists():
        return None
    probe = subprocess.run(
        [str(install.python), "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
        capture_output=True,
        text=True,
    )
    return (probe.stdout.strip() or None) if probe.returncode == 0 else None


def _free_gb(path: Path) -> float:
    existing = path
    while not existing.exists():
        existing = existing.parent
    return shutil.disk_usage(existing).free / 2**30


def install_sglang(install: CpuInstall, python: str) -> bool:
    """Install sglang into the venv unless it is there; True if anything was done."""
    version = install.stamp().get("sglang") if install.python.exists() else None
    version = version or installed_sglang(install)
    if version == SGLANG_CPU_VERSION:
        _say(f"sglang=={version} already installed in {install.root}: reusing it")
        return False
    free = _free_gb(install.root)
    if free < NEEDED_GB:
        raise InstallError(
            f"not enough disk space at {install.root}: sglang=={SGLANG_CPU_VERSION} needs about {NEEDED_GB} GB free "
            f"(the install is ~{INSTALL_GB} GB) and {free:.1f} GB are. Free some space, or set "
            "PREFIX_ROUTER_SGLANG_CPU to a directory on a larger disk"
        )
    if not install.python.exists():
        _say(f"creating the virtualenv {install.root} (with {python})")
        install.root.parent.mkdir(parents=True, exist_ok=True)
        created = subprocess.run([python, "-m", "venv", str(install.root)])
        if created.returncode != 0:
            raise InstallError(
                f"could not create a virtualenv with {python} (status {created.returncode}); on Debian or Ubuntu "
                "apt-get install python3-venv, or pass PYTHON=/path/to/python3 to make"
            )
    _say(f"installing sglang=={SGLANG_CPU_VERSION} (a few minutes, ~{INSTALL_GB} GB) ...")
    pip = subprocess.run(
        [str(install.python), "-m", "pip", "install", "--no-cache-dir", "--quiet", f"sglang=={SGLANG_CPU_VERSION}"]
    )
    if pip.returncode != 0:
        raise InstallError(f"pip install sglang=={SGLANG_CPU_VERSION} failed (status {pip.returncode}; see above)")
    return True


def build_stub(install: CpuInstall, compiler: str) -> bool:
    target = install.libcuda_dir / "libcuda.so.1"
    if target.exists() and install.stamp().get("libcuda") == stub_digest():
        _say(f"libcuda.so.1 stand-in up to date: {target}")
        return False
    install.libcuda_dir.mkdir(parents=True, exist_ok=True)
    source = CPU_DIR / "libcuda_stub.c"
    _build("the libcuda.so.1 stand-in", [compiler, "-shared", "-fPIC", "-O2", "-o", str(target), str(source)])
    _say(f"built the libcuda.so.1 stand-in: {target}")
    return True


def build_model(install: CpuInstall, tokenizer: Path) -> bool:
    if (install.model_dir / "config.json").exists() and install.stamp().get("model") == model_digest(tokenizer):
        _say(f"tiny Llama up to date: {install.model_dir}")
        return False
    script = CPU_DIR / "build_tiny_model.py"
    argv = [str(install.python), str(script), "--tokenizer", str(tokenizer), "--out", str(install.model_dir)]
    _build("the tiny Llama", argv, cpu_environment(install))
    _say(f"built the tiny Llama from {tokenizer}: {install.model_dir}")
    return True


def _build(what: str, argv: list[str], env: dict[str, str] | None = None) -> None:
    """Run one build step; InstallError with the end of its output when it fails."""
    built = subprocess.run(argv, env=env, capture_output=True, text=True)
    if built.returncode != 0:
        raise InstallError(f"building {what} failed ({argv[0]}):\n{(built.stderr or built.stdout).strip()[-2000:]}")


PD_PROBE = "import msgpack; from mooncake.engine import TransferEngine"


def install_pd_packages(install: CpuInstall) -> bool:
    """Add what a PD pair needs to the venv unless it is there (idempotent); True if pip ran."""
    wanted = ",".join(PD_PIP_PACKAGES)
    pinned = PD_PIP_PACKAGES[0].split("==")
    probe = subprocess.run(
        [str(install.python), "-c", f"import importlib.metadata as m; print(m.version({pinned[0]!r})); import msgpack"],
        capture_output=True,
        text=True,
    )
    if install.stamp().get("pd") == wanted or (probe.returncode == 0 and probe.stdout.strip() == pinned[1]):
        _say(f"{' and '.join(PD_PIP_PACKAGES)} already installed: reusing them")
        return False
    _say(f"installing {' and '.join(PD_PIP_PACKAGES)} for prefill/decode pairs ...")
    pip = subprocess.run([str(install.python), "-m", "pip", "install", "--quiet", *PD_PIP_PACKAGES])
    if pip.returncode != 0:
        raise InstallError(f"pip install {' '.join(PD_PIP_PACKAGES)} failed (status {pip.returncode}; see above)")
    return True


def check_pd_imports(install: CpuInstall) -> None:
    """Mooncake's engine loads (its engine.so links libibverbs and libnl even for TCP transfers)."""
    checked = subprocess.run(
        [str(install.python), "-c", PD_PROBE], env=cpu_environment(install), capture_output=True, text=True
    )
    if checked.returncode != 0:
        detail = (checked.stderr or checked.stdout).strip().splitlines()[-1:] or [""]
        raise InstallError(
            f"Mooncake's transfer engine does not load ({detail[0]}); it needs the Debian packages "
            f"{' '.join(PD_DEBIAN_PACKAGES)}: apt-get install {' '.join(PD_DEBIAN_PACKAGES)}"
        )


def check_imports(install: CpuInstall) -> None:
    checked = subprocess.run(
        [str(install.python), "-c", "import sgl_kernel, sglang; print(sglang.__version__)"],
        env=cpu_environment(install),
        capture_output=True,
        text=True,
    )
    if checked.returncode != 0 or checked.stdout.strip() != SGLANG_CPU_VERSION:
        raise InstallError(
            "sglang does not import with the stand-in on LD_LIBRARY_PATH:\n"
            + (checked.stderr or checked.stdout).strip()[-2000:]
        )


def may_apt() -> bool:
    """Whether missing Debian packages can be installed here: root, with apt-get (a CI machine, a container)."""
    return os.geteuid() == 0 and shutil.which("apt-get") is not None


def apt_install(packages: list[str]) -> None:
    """``apt-get update`` then ``apt-get install`` (quietly, no recommends), as ``.ci/run`` does; failures are
    left to the caller's second look at the library listing."""
    _say(f"installing the Debian packages {' '.join(packages)} for prefill/decode pairs ...")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], env=env, stdout=subprocess.DEVNULL)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages], env=env, stdout=subprocess.DEVNULL
    )


def install_pd(
    install: CpuInstall, apt: bool | None = None, libraries: Callable[[], str] = ldconfig_listing
) -> str | None:
    """Step 4: what a prefill/decode pair needs. None when it is done; else one line saying what PD still needs.

    ``apt``: install missing Debian packages with apt-get (None: when ``may_apt()``); ``libraries``: the
    dynamic linker's listing (``ldconfig -p``).
    """
    missing = missing_pd_packages(libraries())
    if missing and (may_apt() if apt is None else apt):
        apt_install(missing)
        missing = missing_pd_packages(libraries())
    if missing:
        packages = " ".join(missing)
        return (
            f"prefill/decode pairs also need the Debian packages {packages} (Mooncake's engine.so links them): "
            f"as root, apt-get install {packages}, then run make sglang-cpu again"
        )
    try:
        changed = install_pd_packages(install)
        if changed or install.stamp().get("pd") != ",".join(PD_PIP_PACKAGES):
            check_pd_imports(install)
    except InstallError as exc:
        return f"prefill/decode pairs are not ready: {exc}"
    return None


def install(
    root: Path,
    python: str,
    tokenizer: Path = DEFAULT_TOKENIZER_DIR,
    apt: bool | None = None,
    libraries: Callable[[], str] = ldconfig_listing,
) -> tuple[CpuInstall, str | None]:
    """Run every step that is not done yet: the install (complete for aggregated workers) and, when PD is not
    ready, one line saying what it still needs (``install_pd``)."""
    target = CpuInstall(root)
    compiler = find_compiler()  # before pip: fail in a second, not after minutes of downloads
    changed = install_sglang(target, python)
    changed = build_stub(target, compiler) or changed
    changed = build_model(target, tokenizer) or changed
    if changed or not target.stamp_path.exists():
        check_imports(target)  # ~15 s: only after something was (re)built
    stamp = {"sglang": SGLANG_CPU_VERSION, "libcuda": stub_digest(), "model": model_digest(tokenizer)}
    pd_stamp = target.stamp().get("pd")
    # Recorded before the PD step: whatever becomes of it, aggregated workers can run from here on.
    target.stamp_path.write_text(json.dumps({**stamp, **({"pd": pd_stamp} if pd_stamp else {})}, indent=2) + "\n")
    pd_missing = install_pd(target, apt, libraries)
    if pd_missing is None:
        stamp["pd"] = ",".join(PD_PIP_PACKAGES)
    target.stamp_path.write_text(json.dumps(stamp, indent=2) + "\n")
    return target, pd_missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_workers.real.install",
        description="Install (or reuse) real SGLang 0.5.23 for CPU serving: venv, libcuda.so.1 stand-in, tiny Llama.",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=default_install_dir(),
        help="Install directory (default: $PREFIX_ROUTER_SGLANG_CPU or ~/.cache/prefix-router/sglang-0.5.23).",
    )
    parser.add_argument(
        "--python", default=sys.executable, help="Interpreter the venv is created with (3.10 or newer)."
    )
    parser.add_argument(
        "--no-apt",
        action="store_true",
        help="Never run apt-get (by default, as root, it installs the Debian packages prefill/decode pairs need).",
    )
    args = parser.parse_args(argv)
    try:
        done, pd_missing = install(args.dir, args.python, apt=False if args.no_apt else None)
    except InstallError as exc:
        print(f"sglang-cpu: {exc}", file=sys.stderr)
        return 1
    _say(f"ready: {done.root} (prefix-router sglang-launch --cpu --run starts a worker)")
    if pd_missing is not None:
        _say(pd_missing)
    return 0


if __name__ == "__main__":
    sys.exit(main())
