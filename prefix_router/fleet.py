"""Start a fleet of workers of either engine, ready to serve, on free loopback ports: ``start_fleet``.

The one way tests, benchmarks and ``prefix-router up`` start workers::

    workers = start_fleet("sim", 4, profile="instant", page_size=16)
    workers = start_fleet("sglang-cpu", 2, capacity_tokens=4096, log_dir=Path("logs"))

Every worker is a ``sglang_workers.process.WorkerProcess`` (stop each, or use one as a context manager); none
outlives the process that started it. On any failure the workers already started are stopped and
``WorkerStartError`` (whose message quotes the failing worker's log) is raised.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from sglang_workers.process import Engine, WorkerProcess, WorkerStartError
from sglang_workers.sim.launch import SimOption

__all__ = ["ENGINES", "Engine", "WorkerProcess", "WorkerStartError", "start_fleet"]

ENGINES: tuple[Engine, ...] = ("sim", "sglang-cpu")
PORT_RACE_ATTEMPTS = 3  # a sim worker that lost a port to another process is started again on new ports


def start_fleet(
    engine: Engine,
    n: int,
    *,
    host: str = "127.0.0.1",
    profile: str | None = None,
    page_size: int | None = None,
    capacity_tokens: int | None = None,
    dp_size: int | None = None,
    seed: int | None = None,
    grpc: bool = False,
    env: Mapping[str, str] | None = None,
    startup_timeout: float | None = None,
    wait_ready: bool = True,
    log_dir: Path | None = None,
    extra_args: Sequence[str] = (),
    **sim_options: SimOption,
) -> list[WorkerProcess]:
    """Start ``n`` workers of ``engine`` in parallel and wait until every one answers ``/ready`` with 200.

    - ``engine``: ``"sim"`` (``prefix-router sim-worker``) or ``"sglang-cpu"`` (real SGLang 0.5.23 on this CPU,
      after ``make sglang-cpu``).
    - ``profile`` (sim): a timing profile, or ``"a,b"``: cycled over the workers (a mixed fleet), or over the DP
      ranks of each worker when ``dp_size`` > 1.
    - ``page_size``: tokens per KV page (default 16 for real SGLang, the simulator's own default otherwise).
    - ``capacity_tokens``: the KV pool in tokens (sim ``--capacity-tokens``, SGLang ``--max-total-tokens``,
      default 8192 there).
    - ``dp_size`` (sim): data-parallel ranks per worker; ``seed``: sim ``--seed`` / SGLang ``--random-seed``.
    - ``grpc`` (sim): also serve SGLang's gRPC scheduler API on a free port (``WorkerProcess.grpc_url``).
    - ``env``: added to the workers' environment.
    - ``startup_timeout``: per worker (default 30 s sim, 300 s real SGLang); ``wait_ready=False`` (sim): wait
      only until the HTTP port answers at all (e.g. 503 during ``load_time``).
    - ``log_dir`` (sglang-cpu): keep each worker's log there (``sglang-<port>.log``), else temporary files.
    - ``extra_args`` (sglang-cpu): more ``sglang.launch_server`` flags.
    - ``**sim_options`` (sim): any other ``prefix-router sim-worker`` flag (``context_length=4096`` ->
      ``--context-length 4096``; ``True`` -> a bare flag such as ``no_kv_events=True``), e.g. the HiCache ones
      (``enable_hierarchical_cache=True, hicache_storage_backend="file", file_storage_path=...``).
    """
    if n < 0:
        raise ValueError(f"a fleet of {n} workers")
    if engine == "sim":
        if log_dir is not None or extra_args:
            raise ValueError("log_dir and extra_args apply to sglang-cpu workers; sim workers take sim-worker options")
        return _start_sim(
            n,
            host=host,
            profile=profile,
            options={
                "page_size": page_size,
                "capacity_tokens": capacity_tokens,
                "dp_size": dp_size,
                "seed": seed,
                **sim_options,
            },
            grpc=grpc,
            env=env,
            startup_timeout=startup_timeout,
            wait_ready=wait_ready,
        )
    if engine == "sglang-cpu":
        unsupported = {
            name: value
            for name, value in {"profile": profile, "dp_size": dp_size, "grpc": grpc or None, **sim_options}.items()
            if value is not None
        }
        if unsupported:
            raise ValueError(f"sglang-cpu workers take no {', '.join(sorted(unsupported))} (sim-worker options)")
        return _start_cpu(
            n,
            host=host,
            page_size=page_size or 16,
            capacity_tokens=capacity_tokens or 8192,
            seed=seed,
            env=env,
            startup_timeout=startup_timeout,
            log_dir=log_dir,
            extra_args=extra_args,
        )
    raise ValueError(f"unknown engine {engine!r}: one of {', '.join(ENGINES)}")


def _start_sim(
    n: int,
    *,
    host: str,
    profile: str | None,
    options: dict[str, SimOption],
    grpc: bool,
    env: Mapping[str, str] | None,
    startup_timeout: float | None,
    wait_ready: bool,
) -> list[WorkerProcess]:
    from sglang_workers.sim.launch import STARTUP_TIMEOUT_S, spawn_sim_worker

    timeout = STARTUP_TIMEOUT_S if startup_timeout is None else startup_timeout
    # Several DP ranks: every worker gets the whole list and cycles it over its ranks.
    ranked = int(options.get("dp_size") or 1) > 1
    profiles = [p.strip() for p in profile.split(",")] if profile and not ranked else []
    per_worker = [{**options, "profile": profiles[i % len(profiles)] if profiles else profile} for i in range(n)]

    def spawn(i: int) -> WorkerProcess:
        return spawn_sim_worker(per_worker[i], host=host, env=env, grpc=grpc, startup_timeout_s=timeout)

    workers: list[WorkerProcess] = []
    try:
        for i in range(n):
            workers.append(spawn(i))
        for i in range(n):
            for attempt in range(PORT_RACE_ATTEMPTS):
                try:
                    workers[i].wait_ready(ready=wait_ready)
                    break
                except WorkerStartError as exc:  # wait_ready stopped it
                    if attempt == PORT_RACE_ATTEMPTS - 1 or "in use" not in str(exc).lower():
                        raise
                    workers[i] = spawn(i)
    except BaseException:
        for worker in workers:
            worker.stop()
        raise
    return workers


def _start_cpu(
    n: int,
    *,
    host: str,
    page_size: int,
    capacity_tokens: int,
    seed: int | None,
    env: Mapping[str, str] | None,
    startup_timeout: float | None,
    log_dir: Path | None,
    extra_args: Sequence[str],
) -> list[WorkerProcess]:
    from sglang_workers.real.cpu_launch import STARTUP_TIMEOUT_S, spawn_cpu_worker
    from sglang_workers.real.installation import find_install, missing_install_reason

    install = find_install()
    if install is None:
        raise WorkerStartError(missing_install_reason() or "real SGLang on CPU is not installed")
    extra = [*(["--random-seed", str(seed)] if seed is not None else []), *extra_args]
    workers: list[WorkerProcess] = []
    try:
        for _ in range(n):
            workers.append(
                spawn_cpu_worker(
                    install,
                    host=host,
                    page_size=page_size,
                    max_total_tokens=capacity_tokens,
                    extra=extra,
                    log_dir=log_dir,
                    env=dict(env or {}),
                    startup_timeout_s=STARTUP_TIMEOUT_S if startup_timeout is None else startup_timeout,
                )
            )
        for worker in workers:
            worker.wait_ready()
    except BaseException:
        for worker in workers:
            worker.stop()
        raise
    return workers
