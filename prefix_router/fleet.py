"""Start a fleet of workers of either engine, ready to serve, on free loopback ports: ``start_fleet``.

The one way tests, benchmarks and ``prefix-router up`` start workers::

    workers = start_fleet("sim", 4, profile="instant", page_size=16)
    workers = start_fleet("sglang-cpu", 2, capacity_tokens=4096, log_dir=Path("logs"))
    pd = start_pd_fleet("sim", prefill=2, decode=2, profile="instant")   # pd.prefill, pd.decode, pd.workers

Every worker is a ``sglang_workers.process.WorkerProcess`` (stop each, or use one as a context manager); none
outlives the process that started it. On any failure the workers already started are stopped and
``WorkerStartError`` (whose message quotes the failing worker's log) is raised.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_workers.process import DisaggregationMode, Engine, WorkerProcess, WorkerStartError
from sglang_workers.sim.launch import SimOption

__all__ = ["ENGINES", "Engine", "PdFleet", "WorkerProcess", "WorkerStartError", "start_fleet", "start_pd_fleet"]

ENGINES: tuple[Engine, ...] = ("sim", "sglang-cpu")
PORT_RACE_ATTEMPTS = 3  # a worker that lost a port to another process is started again on new ports


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
    disaggregation_mode: DisaggregationMode = "null",
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
    - ``disaggregation_mode``: ``"prefill"`` or ``"decode"`` makes every worker a PD worker of that side (each
      prefill worker gets a free bootstrap port: ``WorkerProcess.bootstrap_port``); ``start_pd_fleet`` starts
      both sides at once.
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
                "disaggregation_mode": None if disaggregation_mode == "null" else disaggregation_mode,
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
            disaggregation_mode=disaggregation_mode,
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

    return _spawn_ready(n, spawn, ready=wait_ready)


def _spawn_ready(n: int, spawn: Callable[[int], WorkerProcess], *, ready: bool = True) -> list[WorkerProcess]:
    """Spawn ``n`` workers at once, then wait for each; on any failure stop them all and raise.

    A worker picks its free ports before it binds them, and a real SGLang worker binds its HTTP port only at the
    end of a minute-long start, while it and its neighbours bind ports of their own: a worker that lost a port
    that way (``address already in use`` in its log) is started again, on new ports, up to
    ``PORT_RACE_ATTEMPTS`` times in all.
    """
    workers: list[WorkerProcess] = []
    try:
        for i in range(n):
            workers.append(spawn(i))
        for i in range(n):
            for attempt in range(PORT_RACE_ATTEMPTS):
                try:
                    workers[i].wait_ready(ready=ready)
                    break
                except WorkerStartError as exc:  # wait_ready stopped it
                    if attempt == PORT_RACE_ATTEMPTS - 1 or not exc.port_lost:
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
    disaggregation_mode: DisaggregationMode,
) -> list[WorkerProcess]:
    from sglang_workers.real.cpu_launch import STARTUP_TIMEOUT_S, spawn_cpu_worker
    from sglang_workers.real.installation import find_install, missing_install_reason

    install = find_install()
    if install is None:
        raise WorkerStartError(missing_install_reason() or "real SGLang on CPU is not installed")
    if disaggregation_mode != "null" and install.pd_problems():
        raise WorkerStartError(f"a real PD worker cannot start: {'; '.join(install.pd_problems())}")
    extra = [*(["--random-seed", str(seed)] if seed is not None else []), *extra_args]

    def spawn(_: int) -> WorkerProcess:
        return spawn_cpu_worker(
            install,
            host=host,
            page_size=page_size,
            max_total_tokens=capacity_tokens,
            extra=extra,
            log_dir=log_dir,
            env=dict(env or {}),
            startup_timeout_s=STARTUP_TIMEOUT_S if startup_timeout is None else startup_timeout,
            disaggregation_mode=disaggregation_mode,
        )

    return _spawn_ready(n, spawn)


@dataclass
class PdFleet:
    """A prefill/decode disaggregated fleet: its prefill and its decode workers (``stop`` stops both)."""

    prefill: list[WorkerProcess]
    decode: list[WorkerProcess]

    @property
    def workers(self) -> list[WorkerProcess]:
        return [*self.prefill, *self.decode]

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop()

    def __enter__(self) -> PdFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_pd_fleet(engine: Engine, prefill: int, decode: int, **options: Any) -> PdFleet:
    """Start ``prefill`` prefill workers and ``decode`` decode workers of ``engine`` (e.g. 2P2D, 3P1D), ready.

    ``options`` are ``start_fleet``'s (profile, page size, sim-worker flags, ...), the same for both sides. A
    PD request goes to one of each, with ``bootstrap_host`` = the prefill worker's host, ``bootstrap_port`` =
    its ``bootstrap_port`` and a fresh ``bootstrap_room``; the client reads the decode worker's answer.
    """
    if prefill < 1 or decode < 1:
        raise ValueError(f"a PD fleet needs at least one prefill and one decode worker (got {prefill}P{decode}D)")
    if "disaggregation_mode" in options:
        raise ValueError("start_pd_fleet sets disaggregation_mode itself")
    # Both sides start at once (a real SGLang worker takes ~40 s to start: a real pair is ready in one wait).
    with ThreadPoolExecutor(2) as pool:
        modes: tuple[tuple[DisaggregationMode, int], ...] = (("prefill", prefill), ("decode", decode))
        sides = [pool.submit(start_fleet, engine, count, disaggregation_mode=mode, **options) for mode, count in modes]
        errors = [side.exception() for side in sides]
    started = [side.result() for side, error in zip(sides, errors) if error is None]
    failed = next((error for error in errors if error is not None), None)
    if failed is not None:
        for workers in started:
            for worker in workers:
                worker.stop()
        raise failed
    return PdFleet(started[0], started[1])
