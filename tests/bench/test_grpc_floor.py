"""The do-nothing ext_proc server over real gRPC (``--suite grpc-stream-cost``), and behind the real Envoy."""

from __future__ import annotations

import pytest

from benchmarks.suites.grpc_stream_cost import measure
from prefix_router.cli import main as cli_main


@pytest.mark.parametrize(("kind", "lockstep"), [("aio", False), ("sync", False), ("aio", True)])
def test_a_do_nothing_server_answers_every_stream_and_its_cpu_is_read(kind: str, lockstep: bool) -> None:
    cpu_ms, wall_ms = measure(kind, streams=30, body_bytes=1000, messages=3, lockstep=lockstep)
    assert cpu_ms > 0  # the server process's own CPU, from /proc, over the measured streams
    assert wall_ms > 0


def test_unknown_servers_are_refused_with_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(["bench", "--suite", "grpc-stream-cost", "--servers", "tonic"])
    assert exit_.value.code == 2
    assert "list of aio, sync" in capsys.readouterr().err


def test_the_floor_gateway_routes_every_request_to_its_fixed_worker_through_envoy(envoy_bin: str) -> None:
    """``--suite overhead --extproc-floor``'s gateway: the real Envoy, the do-nothing server in the router's place."""
    from benchmarks.fleet.floor_server import floor_command
    from prefix_router.stack import GatewayStack
    from tests.support.gateway_http import envoy_stats, post

    with GatewayStack(sim_workers=2, sim_worker_options={"no_kv_events": True}, router=False) as workers:
        urls = workers.worker_urls
        target = urls[1].removeprefix("http://")
        with GatewayStack(worker_urls=urls, router_command=floor_command("{port}", target), metrics_port=None) as floor:
            chat = {"model": "default", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
            served = {post(floor.url + "/v1/chat/completions", chat).headers["x-upstream-host"] for _ in range(6)}
            picked = envoy_stats(floor.admin_url).get("cluster.prefix_router_picked.upstream_rq_total", 0)
    assert served == {target}  # the fixed reply's worker, never Envoy's own pick
    assert picked == 6  # by the router's reply (the picked route), not by fail-open
