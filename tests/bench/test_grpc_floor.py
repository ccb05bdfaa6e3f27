"""The gRPC floor benchmark over real gRPC: every stream is answered, and the server's CPU is counted."""

from __future__ import annotations

import pytest

from benchmarks.grpc_floor import measure


@pytest.mark.parametrize(("kind", "lockstep"), [("aio", False), ("sync", False), ("aio", True)])
def test_a_do_nothing_server_answers_every_stream_and_its_cpu_is_read(kind: str, lockstep: bool) -> None:
    cpu_ms, wall_ms = measure(kind, streams=30, body_bytes=1000, messages=3, lockstep=lockstep)
    assert cpu_ms > 0  # the server process's own CPU, from /proc, over the measured streams
    assert wall_ms > 0


def test_unknown_servers_are_refused_with_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.grpc_floor import main

    with pytest.raises(SystemExit) as exit_:
        main(["--servers", "tonic"])
    assert exit_.value.code == 2
    assert "--servers takes aio, sync" in capsys.readouterr().err
