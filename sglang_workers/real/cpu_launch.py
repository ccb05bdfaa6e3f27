"""Spawn one real SGLang 0.5.23 worker on this CPU from the ``make sglang-cpu`` install (behind
``sglang_workers.process``).

The router-ready flags of ``flags.sglang_flags`` plus the CPU ones (torch-native attention, no CUDA graphs,
``--sleep-on-idle`` so an idle worker does not spin a core). SGLang runs three processes per worker
(HTTP/tokenizer, scheduler, detokenizer): the worker leads a process group of its own, and the handle signals
the whole group. A worker takes ~34 s to start (~60 s the first time after boot) and ~4 GB of memory.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from prefix_common.addresses import free_ports

from ..process import DisaggregationMode, Launch, WorkerProcess, spawn
from .flags import sglang_flags
from .installation import TINY_MODEL_NAME, CpuInstall

__all__ = ["PD_PATCH_ENV", "cpu_command", "cpu_environment", "cpu_flags", "pd_flags", "spawn_cpu_worker"]

STARTUP_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 20.0
PD_PATCH_ENV = "PREFIX_ROUTER_SGLANG_CPU_PD"  # guard/sitecustomize.py applies the CPU PD adjustment when set


def pd_flags(mode: DisaggregationMode, bootstrap_port: int | None = None) -> list[str]:
    """The flags of one side of a real PD pair on this CPU (measured; see docs/real-sglang.md).

    Both sides move KV over TCP (``mooncake_tcp``: Mooncake with MC_FORCE_TCP, no RDMA NIC needed). The prefill
    side runs without the overlap scheduler and hosts the bootstrap server; the decode side keeps retracted
    requests' KV in a CPU tensor (its default backup needs CUDA).
    """
    if mode == "null":
        return []
    flags = ["--disaggregation-mode", mode, "--disaggregation-transfer-backend", "mooncake_tcp"]
    if mode == "prefill":
        flags.append("--disable-overlap-schedule")
        if bootstrap_port is not None:
            flags += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    else:
        flags += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
    return flags


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


def spawn_cpu_worker(
    install: CpuInstall,
    *,
    host: str = "127.0.0.1",
    page_size: int = 16,
    max_total_tokens: int = 8192,
    extra: Sequence[str] = (),
    ports: tuple[int, int, int] | None = None,
    log_dir: Path | None = None,
    env: dict[str, str] | None = None,
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
    disaggregation_mode: DisaggregationMode = "null",
) -> WorkerProcess:
    """Start one CPU worker on free (or the given) ports; returns at once (see ``wait_ready``).

    With ``log_dir`` its log is ``log_dir/sglang-<port>.log`` and stays after ``stop()``; else a temporary file.
    ``disaggregation_mode`` "prefill" / "decode": one side of a PD pair (``pd_flags``; a prefill worker gets a
    free bootstrap port), with the CPU adjustment of ``guard/sglang_cpu_pd.py`` switched on.
    """
    port, kv_port, replay_port = ports or tuple(free_ports(3, host))
    bootstrap_port = None
    while disaggregation_mode == "prefill" and bootstrap_port in (None, port, kv_port, replay_port):
        bootstrap_port = free_ports(1, host)[0]
    pd_extra = pd_flags(disaggregation_mode, bootstrap_port)
    argv = cpu_command(install, port, kv_port, replay_port, host, page_size, max_total_tokens, [*pd_extra, *extra])
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"sglang-{port}.log"
    else:
        fd, name = tempfile.mkstemp(prefix=f"sglang-cpu-{port}-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    launch = Launch(
        engine="sglang-cpu",
        argv=argv,
        env={
            **cpu_environment(install),
            **({PD_PATCH_ENV: "1"} if disaggregation_mode != "null" else {}),
            **(env or {}),
        },
        own_group=True,  # stop() takes the scheduler and detokenizer down with it
        startup_timeout_s=startup_timeout_s,
        stop_timeout_s=STOP_TIMEOUT_S,
        ready_poll_s=0.5,
        keep_log=log_dir is not None,
    )
    return WorkerProcess(
        launch,
        host,
        port,
        kv_port,
        replay_port,
        spawn(launch, log_path),
        log_path,
        disaggregation_mode=disaggregation_mode,
        bootstrap_port=bootstrap_port,
    )
