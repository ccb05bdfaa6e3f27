"""``prefix-router bench --suite gpu-timing-fit FILE``: the simulator's timing constants, fitted to what
``python3 benchmarks/gpu_timing.py measure`` timed on a real GPU.

The simulated worker prices a prefill batch as ``c0 + sum(a*L + b*(L*L + 2*P*L))`` and a decode step
as ``d0 + d1*B + d2*C`` (``sglang_workers/sim/timing.py``). This reads the JSON the measurement wrote
(``benchmarks/data/gpu-timing-h200-run*.json`` are two H200 runs) and solves those constants by least
squares on relative error (the points span three orders of magnitude), printing each point's residual,
the throughput the constants imply, and the eager (launch-bound) prefill fit beside the CUDA-graph one.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.gpu_timing import ModelShape

__all__ = ["configure", "fit_decode", "fit_prefill", "main"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, help="The JSON `python3 benchmarks/gpu_timing.py measure` wrote.")


def _solve(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> list[float]:
    """Least squares ``rows @ x ~= targets`` by the normal equations (a few unknowns, well scaled)."""
    n = len(rows[0])
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(n)]
    scaled = [[r[j] / scale[j] for j in range(n)] for r in rows]
    m = [[sum(r[i] * r[j] for r in scaled) for j in range(n)] for i in range(n)]
    y = [sum(r[i] * t for r, t in zip(scaled, targets, strict=True)) for i in range(n)]
    for col in range(n):  # Gauss-Jordan with partial pivoting
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot], y[col], y[pivot] = m[pivot], m[col], y[pivot], y[col]
        for r in range(n):
            if r != col and m[col][col]:
                factor = m[r][col] / m[col][col]
                m[r] = [x - factor * z for x, z in zip(m[r], m[col], strict=True)]
                y[r] -= factor * y[col]
    return [y[i] / m[i][i] / scale[i] for i in range(n)]


def fit_prefill(points: Sequence[dict[str, Any]], key: str = "graph_s") -> dict[str, float]:
    """``c0``, ``a``, ``b`` of ``T = c0 + sum(a*L + b*(L*L + 2*P*L))`` minimising relative error."""
    rows, targets = [], []
    for point in points:
        t = float(point[key])
        chunks = point["chunks"]
        linear = sum(n for n, _ in chunks)
        attention = sum(n * n + 2 * p * n for n, p in chunks)
        rows.append([1.0 / t, linear / t, attention / t])
        targets.append(1.0)
    c0, a, b = _solve(rows, targets)
    return {"c0": c0, "a": a, "b": b}


def fit_decode(points: Sequence[dict[str, Any]]) -> dict[str, float]:
    """``d0``, ``d1``, ``d2`` of ``T = d0 + d1*B + d2*C`` minimising relative error."""
    rows, targets = [], []
    for point in points:
        t = float(point["graph_s"])
        rows.append([1.0 / t, point["batch"] / t, point["context_tokens"] / t])
        targets.append(1.0)
    d0, d1, d2 = _solve(rows, targets)
    return {"d0": d0, "d1": d1, "d2": d2}


def main(args: argparse.Namespace) -> int:
    try:
        with open(args.file) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        print(f"prefix-router bench: cannot read {args.file}: {exc}", file=sys.stderr)
        return 2
    meta = data.get("meta", {})
    print(f"# {meta.get('gpu')} torch {meta.get('torch')} CUDA {meta.get('cuda')}, {meta.get('started')}")
    for name, entry in data.get("models", {}).items():
        if not entry.get("prefill"):
            print(f"\n## {name}: nothing measured ({entry.get('skipped') or entry.get('error')})")
            continue
        shape = ModelShape(**entry["shape"])
        print(f"\n## {name}" + (f" (stopped early: {entry['error']})" if "error" in entry else ""))
        for key in ("graph_s", "eager_s"):
            pre = fit_prefill(entry["prefill"], key)
            print(
                f"prefill ({key[:-2]}): c0 {pre['c0'] * 1e3:.2f} ms, a {pre['a'] * 1e6:.2f} us/token, "
                f"b {pre['b'] * 1e9:.3f} ns/token^2"
            )
        pre = fit_prefill(entry["prefill"])
        flops = 2 * shape.linear_params
        attention_flops = 4 * shape.heads * shape.head_dim * shape.layers  # per (query, key) pair
        print(
            f"  linear part at {flops / pre['a'] / 1e12:.0f} TFLOP/s; attention at "
            f"{attention_flops / (2 * pre['b']) / 1e12:.0f} TFLOP/s (b counts each causal pair twice)"
        )
        print("  chunks (L, P) x count | graph ms | eager ms | model ms | error")
        for point in entry["prefill"]:
            chunks = point["chunks"]
            model = pre["c0"] + sum(pre["a"] * n + pre["b"] * (n * n + 2 * p * n) for n, p in chunks)
            print(
                f"  {tuple(chunks[0])} x{len(chunks)} | {point['graph_s'] * 1e3:.2f} | "
                f"{point['eager_s'] * 1e3:.2f} | {model * 1e3:.2f} | {model / point['graph_s'] - 1:+.0%}"
            )
        if entry.get("decode"):
            dec = fit_decode(entry["decode"])
            print(
                f"decode: d0 {dec['d0'] * 1e3:.2f} ms, d1 {dec['d1'] * 1e6:.1f} us/seq, "
                f"d2 {dec['d2'] * 1e9:.1f} ns/KV token"
            )
            weight_bytes = 2 * (shape.linear_params + shape.vocab * shape.hidden)
            print(
                f"  weights streamed at {weight_bytes / dec['d0'] / 1e12:.2f} TB/s; "
                f"KV read at {shape.kv_bytes_per_token / dec['d2'] / 1e12:.2f} TB/s"
            )
            print("  B | c per seq | graph ms | model ms | error")
            for point in entry["decode"]:
                model = dec["d0"] + dec["d1"] * point["batch"] + dec["d2"] * point["context_tokens"]
                print(
                    f"  {point['batch']} | {point['context_per_seq']} | {point['graph_s'] * 1e3:.2f} | "
                    f"{model * 1e3:.2f} | {model / point['graph_s'] - 1:+.0%}"
                )
    return 0
