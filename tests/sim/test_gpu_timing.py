"""The GPU timing fit, and the H200 profile against the measurement committed beside the benchmark.

``benchmarks/data/gpu-timing-h200-run*.json`` are two runs of ``benchmarks/gpu_timing.py measure``
on an H200 (2026-12-04); the ``llama-3.1-8b-h200`` profile takes its constants from them, and this
checks that it still does.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from benchmarks.gpu_timing import SHAPES
from benchmarks.suites.gpu_timing_fit import fit_decode, fit_prefill
from sglang_workers.sim.timing import get_profile

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_timing.py"  # run as a script on a GPU machine
DATA = SCRIPT.parent / "data"
RUNS = sorted(DATA.glob("gpu-timing-h200-run*.json"))


def test_fit_recovers_the_constants_of_a_model_it_was_given() -> None:
    c0, a, b = 0.012, 31e-6, 0.7e-9
    batches = [[(n, p)] for n in (1, 64, 512, 4096) for p in (0, 8192)] + [[(256, 0)] * 4]
    prefill = [
        {"chunks": [list(c) for c in batch], "graph_s": c0 + sum(a * n + b * (n * n + 2 * p * n) for n, p in batch)}
        for batch in batches
    ]
    got = fit_prefill(prefill)
    assert got == pytest.approx({"c0": c0, "a": a, "b": b}, rel=1e-6)
    d0, d1, d2 = 0.006, 20e-6, 40e-9
    decode = [
        {"batch": bs, "context_tokens": bs * c, "graph_s": d0 + d1 * bs + d2 * bs * c}
        for bs in (1, 8, 64)
        for c in (256, 4096)
    ]
    assert fit_decode(decode) == pytest.approx({"d0": d0, "d1": d1, "d2": d2}, rel=1e-6)


def _llama_8b(path: Path) -> dict:
    entry = json.loads(path.read_text())["models"]["llama-3.1-8b"]
    assert entry["shape"] == asdict(SHAPES["llama-3.1-8b"])
    return entry


def test_two_h200_runs_agree_and_the_h200_profile_is_their_fit() -> None:
    assert len(RUNS) == 2, RUNS
    fits = []
    for path in RUNS:
        entry = _llama_8b(path)
        assert len(entry["prefill"]) >= 30 and len(entry["decode"]) >= 25
        fits.append(
            (fit_prefill(entry["prefill"]), fit_prefill(entry["prefill"], "eager_s"), fit_decode(entry["decode"]))
        )
    (graph1, eager1, dec1), (graph2, _, dec2) = fits
    assert graph1 == pytest.approx(graph2, rel=0.02) and dec1 == pytest.approx(dec2, rel=0.02)
    h200 = get_profile("llama-3.1-8b-h200")
    for name in ("d0", "d1", "d2"):
        assert getattr(h200, name) == pytest.approx(dec1[name], rel=0.03), name
    assert h200.a == pytest.approx(graph1["a"], rel=0.03)
    # c0: the eager (launch-bound) floor, not the GPU's alone, since SGLang launches prefill eagerly.
    assert h200.c0 == pytest.approx(eager1["c0"], rel=0.15) and h200.c0 > 2 * graph1["c0"]
    # b: FlashAttention-3's; the FlashAttention-2 kernel measured is slower.
    assert h200.b < graph1["b"]


def test_a_prefill_batch_pays_its_floor_once() -> None:
    """Eight 64-token requests in one forward cost far less than eight forwards (the simulator's form)."""
    entry = _llama_8b(RUNS[0])
    time_of = {(len(p["chunks"]), tuple(p["chunks"][0])): p["graph_s"] for p in entry["prefill"]}
    one, eight = time_of[(1, (64, 0))], time_of[(8, (64, 0))]
    assert eight < 3 * one < 8 * one


def test_fit_command_prints_the_constants_and_refuses_a_missing_file(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "prefix_router", "bench", "--suite", "gpu-timing-fit", str(RUNS[0])],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "NVIDIA H200" in done.stdout and "decode: d0 6.28 ms" in done.stdout
    missing = subprocess.run(
        [sys.executable, "-m", "prefix_router", "bench", "--suite", "gpu-timing-fit", str(tmp_path / "none.json")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert missing.returncode == 2 and "cannot read" in missing.stderr and "Traceback" not in missing.stderr


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="PyTorch is installed here")
def test_measure_without_pytorch_says_what_it_needs(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "measure", "--out", str(tmp_path / "t.json")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2 and "needs PyTorch" in done.stderr and "Traceback" not in done.stderr
