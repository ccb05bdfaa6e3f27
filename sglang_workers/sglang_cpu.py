"""Real SGLang 0.5.23 on this machine's CPU: where the install lives, how a worker is launched and stopped.

``make sglang-cpu`` (``sglang_workers.sglang_cpu_install``) puts three things in one per-user directory
keyed by the SGLang version, ``${XDG_CACHE_HOME:-~/.cache}/prefix-router/sglang-0.5.23`` (or
``$PREFIX_ROUTER_SGLANG_CPU``): a virtualenv with ``sglang==0.5.23`` (its own pins, apart from the
project's ``.venv``), a ``libcuda.so.1`` stand-in built from ``cpu/libcuda_stub.c`` (the CUDA-built
``sgl_kernel`` wheel needs the driver library to import; nothing calls it on the CPU path), and a tiny
random-weight Llama built from the project's default tokenizer (``cpu/build_tiny_model.py``).

This module finds that install (``find_install``) and runs workers from it: the router-ready flags of
``sglang_flags.sglang_flags`` plus the CPU ones (torch-native attention, no CUDA graphs,
``--sleep-on-idle`` so an idle worker does not spin a core). ``start_cpu_workers`` starts them as child
processes in their own process groups (SGLang runs three processes per worker: HTTP/tokenizer,
scheduler, detokenizer), waits on ``/ready``, and stops each whole group. A worker takes ~34 s to start
(~60 s the first time after boot) and ~4 GB of memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from extproc.addresses import free_ports
from extproc.tokenization import DEFAULT_TOKENIZER_DIR

from .sglang_flags import sglang_flags

__all__ = [
    "CPU_DIR",
    "SGLANG_CPU_VERSION",
    "TINY_MODEL_NAME",
    "TINY_MODEL_VOCAB",
    "CpuInstall",
    "CpuWorkerError",
    "SGLangCpuWorker",
    "cpu_environment",
    "cpu_flags",
    "default_install_dir",
    "find_install",
    "missing_install_reason",
    "start_cpu_workers",
]

SGLANG_CPU_VERSION = "0.5.23"  # the release the simulator reproduces and these workers run
CPU_DIR = Path(__file__).resolve().parent / "cpu"  # the stub's C source and the model builder
TINY_MODEL_NAME = "tiny-llama"  # --served-model-name of the CPU workers
TINY_MODEL_VOCAB = 8192  # the default tokenizer's vocabulary (largest id 8191) = the model's
STAMP = "prefix-router-sglang-cpu.json"  # what was built, from which sources


def default_install_dir() -> Path:
    """``$PREFIX_ROUTER_SGLANG_CPU``, else ``${XDG_CACHE_HOME:-~/.cache}/prefix-router/sglang-<version>``."""
    override = os.environ.get("PREFIX_ROUTER_SGLANG_CPU")
    if override:
        return Path(override).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "prefix-router" / f"sglang-{SGLANG_CPU_VERSION}"


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


def cpu_flags(max_total_tokens: int = 8192) -> list[str]:
    """The flags that make SGLang 0.5.23 serve on a CPU (measured; see docs/real-sglang.md)."""
    return [
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",  # the x86 default, intel_amx, needs AMX
        "--sampling-backend",
        "pytorch",
        "--cuda-graph-backend-decode",
        "disabled",
        "--cuda-graph-backend-prefill",
        "disabled",
        "--dtype",
        "bfloat16",
        "--tp",
        "1",
        "--mem-fraction-static",
        "0.3",
        "--max-total-tokens",
        str(max_total_tokens),  # the KV pool, in tokens: small pools make evictions easy to provoke
        "--sleep-on-idle",  # without it the idle scheduler spins one core at 100%
    ]


def cpu_environment(install: CpuInstall, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a CPU worker: the CPU engine, the stand-in on the library path, no downloads."""
    env = dict(os.environ if base is None else base)
    library_path = env.get("LD_LIBRARY_PATH")
    env.update(
        {
            "SGLANG_USE_CPU_ENGINE": "1",  # without it the rotary embedding imports vllm
            "LD_LIBRARY_PATH": f"{install.libcuda_dir}:{library_path}" if library_path else str(install.libcuda_dir),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def cpu_command(
    install: CpuInstall,
    port: int,
    kv_events_port: int,
    replay_port: int,
    host: str = "127.0.0.1",
    page_size: int = 16,
    max_total_tokens: int = 8192,
    extra: Sequence[str] = (),
) -> list[str]:
    """argv of one CPU worker serving the tiny Llama with the router-ready flags."""
    argv = [str(install.python), "-m", "sglang.launch_server", "--model-path", str(install.model_dir)]
    argv += ["--served-model-name", TINY_MODEL_NAME]
    flags = sglang_flags(host, port, page_size, kv_events_port, replay_port, events_host=host)
    for flag, value in flags.items():
        argv += [flag] if value is True else [flag, str(value)]
    return argv + cpu_flags(max_total_tokens) + list(extra)


class CpuWorkerError(RuntimeError):
    """A CPU worker failed to start; the message carries the end of its log."""


@dataclass
class SGLangCpuWorker:
    """One running real SGLang CPU worker (the launch_server process leads its own process group)."""

    host: str
    port: int
    kv_events_port: int
    replay_port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    args: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def kv_events_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.kv_events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.replay_port}"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, timeout: float) -> None:
        """Wait until ``/ready`` answers 200 (SGLang sets it once its warm-up request has been served)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise CpuWorkerError(
                    f"SGLang exited with status {self.process.returncode} while starting:\n{self.log()[-3000:]}"
                )
            with (
                contextlib.suppress(urllib.error.URLError, OSError),
                urllib.request.urlopen(self.url + "/ready", timeout=2) as response,
            ):
                if response.status == 200:
                    return
            time.sleep(0.5)
        raise CpuWorkerError(f"SGLang not ready after {timeout:.0f}s:\n{self.log()[-3000:]}")

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the worker's process group (HTTP, scheduler, detokenizer), SIGKILL what outlives it."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)  # children SGLang did not take down itself
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)

    def restart(self, timeout: float = 300.0) -> None:
        """Start the same command again on the same ports (after a crash) and wait until it is ready."""
        self.stop()
        with self.log_path.open("ab") as handle:
            self.process = subprocess.Popen(
                self.args,
                stdin=subprocess.DEVNULL,
                stdout=handle,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        self.wait_ready(timeout)

    def kill(self) -> None:
        """A crash, not a goodbye: SIGKILL the whole group at once (tests of restarts use this)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)

    def __enter__(self) -> SGLangCpuWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def spawn_cpu_worker(
    install: CpuInstall,
    host: str = "127.0.0.1",
    page_size: int = 16,
    max_total_tokens: int = 8192,
    extra: Sequence[str] = (),
    ports: tuple[int, int, int] | None = None,
    log_dir: Path | None = None,
) -> SGLangCpuWorker:
    """Start one CPU worker on free (or the given) ports; returns at once (see ``wait_ready``)."""
    port, kv_port, replay_port = ports or tuple(free_ports(3, host))
    argv = cpu_command(install, port, kv_port, replay_port, host, page_size, max_total_tokens, extra)
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"sglang-{port}.log"
        handle = log_path.open("ab")
    else:
        fd, name = tempfile.mkstemp(prefix=f"sglang-cpu-{port}-", suffix=".log")
        log_path, handle = Path(name), os.fdopen(fd, "wb")
    env = cpu_environment(install)
    with handle:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=handle,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own group: stop() takes the scheduler and detokenizer down too
        )
    return SGLangCpuWorker(host, port, kv_port, replay_port, process, log_path, argv, env)


def start_cpu_workers(
    count: int,
    install: CpuInstall | None = None,
    *,
    host: str = "127.0.0.1",
    page_size: int = 16,
    max_total_tokens: int = 8192,
    extra: Sequence[str] = (),
    log_dir: Path | None = None,
    startup_timeout: float = 300.0,
) -> list[SGLangCpuWorker]:
    """Start ``count`` CPU workers in parallel and wait until every one is ready; on failure stop them all."""
    install = install or find_install()
    if install is None:
        raise CpuWorkerError(missing_install_reason() or "real SGLang on CPU is not installed")
    workers: list[SGLangCpuWorker] = []
    try:
        for _ in range(count):
            workers.append(spawn_cpu_worker(install, host, page_size, max_total_tokens, extra, log_dir=log_dir))
        for worker in workers:
            worker.wait_ready(startup_timeout)
    except BaseException:
        for worker in workers:
            worker.stop()
        raise
    return workers
