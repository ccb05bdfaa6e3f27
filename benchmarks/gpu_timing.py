"""Measure the simulator's timing model on a real GPU, and fit its constants from the measurement.

The simulated worker prices a prefill batch as ``c0 + sum(a*L + b*(L*L + 2*P*L))`` and a decode
step as ``d0 + d1*B + d2*C`` (``sglang_workers/sim/timing.py``). Those constants were first derived
from published figures; this module measures them instead, on the GPU a profile names.

``measure`` (needs PyTorch and a CUDA GPU; imports nothing else, so it runs on a bare GPU image)
builds a Llama-shaped model with random BF16 weights, written out layer by layer in plain PyTorch as
SGLang's forward pass does it: RMSNorm, fused QKV, rotary embedding, grouped-query attention through
``scaled_dot_product_attention`` (flash kernel), fused gate-up MLP, and logits for the last token
of each request only. It times

* prefill of ``L`` new tokens on ``P`` cached ones, one request and batches of several (the linear
  layers over all the batch's tokens at once, attention per request, as a ragged kernel does it);
* decode steps of ``B`` sequences holding ``c`` KV tokens each.

Each point is captured as a CUDA graph and replayed, so the time is the GPU's alone; prefill is also
timed eagerly (each kernel launched from Python, as SGLang launches prefill), which shows the launch
floor. Why our own forward and not ``transformers``: its eager decode is bound by Python launch
overhead (SGLang replays decode as CUDA graphs), and its attention with a cache goes through a
materialised mask instead of the flash kernel.

``fit`` reads the JSON ``measure`` wrote and solves the timing model's constants by least squares
on relative error (the points span three orders of magnitude), printing each point's residual.

    python3 benchmarks/gpu_timing.py measure --out timing.json     # on the GPU machine
    python -m benchmarks.gpu_timing fit benchmarks/data/gpu-timing-h200-run1.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["SHAPES", "ModelShape", "fit_decode", "fit_prefill", "main"]

# Where ``measure`` runs: "cuda", or "cpu" to check the script end to end on a machine without a GPU
# (eager timing only, tiny points; the figures mean nothing there).
_DEVICE = ["cuda"]


@dataclass(frozen=True)
class ModelShape:
    """What one GPU of a (possibly tensor-parallel) Llama deployment holds."""

    name: str
    layers: int
    hidden: int
    heads: int  # query heads on this GPU
    kv_heads: int  # KV heads on this GPU
    head_dim: int
    intermediate: int  # MLP width on this GPU
    vocab: int  # vocabulary rows on this GPU (the LM head is vocabulary-parallel under TP)

    @property
    def linear_params(self) -> int:
        """Weights every prompt token multiplies through (all layers, not the LM head)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate
        return per_layer * self.layers

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * 2


# Llama-3.1-8B (32 layers, d_model 4096, 32 query / 8 KV heads, MLP 14336, vocabulary 128256) on one
# GPU; and one GPU's shard of Llama-3.1-70B under TP4 (80 layers, d_model 8192, 64 / 8 heads, MLP
# 28672): a quarter of the heads, the MLP and the vocabulary. The shard leaves out TP4's all-reduces.
SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256),
        ModelShape("llama-3.1-70b-tp4-shard", 80, 8192, 16, 2, 128, 7168, 32064),
    )
}


# --------------------------------------------------------------------------------------- measuring


def _measure(args: argparse.Namespace) -> int:
    try:
        import torch
    except ImportError:
        print("gpu_timing measure: needs PyTorch (python3 -m pip install torch) and a CUDA GPU", file=sys.stderr)
        return 2

    _DEVICE[0] = args.device
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_timing measure: no CUDA GPU visible to PyTorch (--device cpu only checks the script)", file=sys.stderr
        )
        return 2
    started = time.monotonic()
    result: dict[str, Any] = {
        "meta": {
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "dtype": "bfloat16",
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "models": {},
    }

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    result["meta"]["attention_check"] = _attention_self_check(torch)
    save()
    for name in args.models.split(","):
        if time.monotonic() - started > args.budget_s:
            print(f"skipping {name}: past the {args.budget_s:.0f} s budget", flush=True)
            result["models"][name] = {"skipped": "time budget"}
            save()
            continue
        shape = SHAPES[name]
        entry: dict[str, Any] = {"shape": asdict(shape), "prefill": [], "decode": []}
        result["models"][name] = entry
        try:
            _measure_model(torch, shape, entry, save, quick=args.quick, light=name != "llama-3.1-8b")
        except Exception as exc:  # keep what was measured; say what broke
            entry["error"] = f"{type(exc).__name__}: {exc}"
            print(f"{name}: {entry['error']}", flush=True)
        save()
        _empty_cache(torch)
    result["meta"]["seconds"] = round(time.monotonic() - started, 1)
    save()
    return 0


def _attention_self_check(torch: Any) -> dict[str, float]:
    """The attention written below against a plain float32 reference with an explicit mask."""
    gen = torch.Generator(device=_DEVICE[0]).manual_seed(0)
    heads, kv_heads, dim, cached, new = 8, 2, 128, 96, 40
    q = torch.randn(1, heads, new, dim, device=_DEVICE[0], dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, kv_heads, cached + new, dim, device=_DEVICE[0], dtype=torch.bfloat16, generator=gen)
    v = torch.randn(1, kv_heads, cached + new, dim, device=_DEVICE[0], dtype=torch.bfloat16, generator=gen)
    rep = heads // kv_heads
    kf, vf = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    scores = (q.float() @ kf.transpose(-1, -2)) / math.sqrt(dim)
    keep = torch.ones(new, cached + new, dtype=torch.bool, device=_DEVICE[0]).tril(cached)
    ref = (scores.masked_fill(~keep, float("-inf")).softmax(-1) @ vf).to(torch.bfloat16)
    got_prefix = _prefill_attention(torch, q, k, v, cached)
    got_plain = _prefill_attention(torch, q[:, :, :, :], k[:, :, cached:], v[:, :, cached:], 0)
    ref_plain_scores = (q.float() @ kf[:, :, cached:].transpose(-1, -2)) / math.sqrt(dim)
    keep_plain = torch.ones(new, new, dtype=torch.bool, device=_DEVICE[0]).tril()
    ref_plain = (ref_plain_scores.masked_fill(~keep_plain, float("-inf")).softmax(-1) @ vf[:, :, cached:]).to(
        torch.bfloat16
    )
    qd = q[:, :, :1]
    got_decode = _decode_attention(torch, qd, k, v)
    ref_decode = ((qd.float() @ kf.transpose(-1, -2)) / math.sqrt(dim)).softmax(-1) @ vf
    errors = {
        "prefill_on_cache_max_abs_err": float((got_prefix.float() - ref.float()).abs().max()),
        "prefill_max_abs_err": float((got_plain.float() - ref_plain.float()).abs().max()),
        "decode_max_abs_err": float((got_decode.float() - ref_decode).abs().max()),
    }
    # A mismatch is recorded, not fatal: the kernels and their FLOPs are the same either way.
    errors["matches"] = float(max(errors.values()) <= 0.05)
    print("attention check:", errors, flush=True)
    return errors


def _prefill_attention(torch: Any, q: Any, k: Any, v: Any, cached: int) -> Any:
    """New queries ``q`` (1, H, L, D) on keys ``k`` (1, KV, P+L, D): all P cached ones and, causally, the new.

    Two flash calls merged by their log-sum-exp: the cached part with no mask (the group's query
    heads folded into the sequence, so no KV head is copied), the new part causal (square, so the
    kernel's top-left causal mask is the right one).
    """
    _, heads, new, dim = q.shape
    kv_heads = k.shape[1]
    rep = heads // kv_heads
    flash = _flash_op(torch)
    k_rep, v_rep = _repeat_heads(k[:, :, cached:], rep), _repeat_heads(v[:, :, cached:], rep)
    out_n, lse_n = flash(q, k_rep, v_rep, 0.0, True)[:2]
    if cached == 0:
        return out_n
    folded = q.reshape(1, kv_heads, rep * new, dim)
    out_c, lse_c = flash(folded, k[:, :, :cached], v[:, :, :cached], 0.0, False)[:2]
    out_c, lse_c = out_c.reshape(1, heads, new, dim), lse_c.reshape(1, heads, new)
    top = torch.maximum(lse_c, lse_n)
    w_c, w_n = torch.exp(lse_c - top).unsqueeze(-1), torch.exp(lse_n - top).unsqueeze(-1)
    return ((out_c.float() * w_c + out_n.float() * w_n) / (w_c + w_n)).to(q.dtype)


def _repeat_heads(x: Any, rep: int) -> Any:
    """(1, KV, n, D) -> (1, KV*rep, n, D), each KV head serving ``rep`` query heads in turn."""
    one, kv_heads, n, dim = x.shape
    return x.unsqueeze(2).expand(one, kv_heads, rep, n, dim).reshape(one, kv_heads * rep, n, dim)


def _flash_op(torch: Any) -> Any:
    """The flash kernel behind ``scaled_dot_product_attention``, called directly for its log-sum-exp."""
    if _DEVICE[0] == "cuda":
        return torch.ops.aten._scaled_dot_product_flash_attention
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _decode_attention(torch: Any, q: Any, k: Any, v: Any) -> Any:
    """One new query per sequence ``q`` (B, H, 1, D) on all ``c`` keys ``k`` (B, KV, c, D): no mask."""
    batch, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    folded = q.reshape(batch, kv_heads, heads // kv_heads, dim)
    out = _flash_op(torch)(folded, k, v, 0.0, False)[0]
    return out.reshape(batch, heads, 1, dim)


class _Model:
    """Random BF16 weights of one ``ModelShape`` and its forward pass (no sampling beyond argmax)."""

    def __init__(self, torch: Any, shape: ModelShape, max_positions: int) -> None:
        self.torch, self.shape = torch, shape
        gen = torch.Generator(device=_DEVICE[0]).manual_seed(1)
        bf16 = torch.bfloat16

        def weight(rows: int, cols: int) -> Any:
            return torch.randn(rows, cols, device=_DEVICE[0], dtype=bf16, generator=gen).mul_(0.02)

        q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        self.embed = weight(shape.vocab, shape.hidden)
        self.layers = [
            (
                torch.ones(shape.hidden, device=_DEVICE[0], dtype=bf16),
                weight(q + 2 * kv, shape.hidden),
                weight(shape.hidden, q),
                torch.ones(shape.hidden, device=_DEVICE[0], dtype=bf16),
                weight(2 * shape.intermediate, shape.hidden),
                weight(shape.hidden, shape.intermediate),
            )
            for _ in range(shape.layers)
        ]
        self.norm = torch.ones(shape.hidden, device=_DEVICE[0], dtype=bf16)
        self.lm_head = weight(shape.vocab, shape.hidden)
        half = shape.head_dim // 2
        inv = 1.0 / (500000.0 ** (torch.arange(half, device=_DEVICE[0], dtype=torch.float32) / half))
        angles = torch.outer(torch.arange(max_positions, device=_DEVICE[0], dtype=torch.float32), inv)
        self.cos, self.sin = angles.cos().to(bf16), angles.sin().to(bf16)

    def _rope(self, x: Any, positions: Any) -> Any:
        """Rotate (S, heads, D) by each token's position (the half-split form Llama uses)."""
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        x1, x2 = x.chunk(2, dim=-1)
        return self.torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(
        self,
        tokens: Any,
        positions: Any,
        attend: Callable[[int, Any, Any, Any], Any],
        last_rows: Any,
    ) -> Any:
        """Tokens (S,) of all the batch's requests; ``attend(layer, q, k, v)`` writes K/V and attends."""
        torch, s = self.torch, self.shape
        f = torch.nn.functional
        q_width, kv_width = s.heads * s.head_dim, s.kv_heads * s.head_dim
        hidden = f.embedding(tokens, self.embed)
        for index, (ln1, qkv_w, o_w, ln2, gate_up_w, down_w) in enumerate(self.layers):
            x = f.rms_norm(hidden, (s.hidden,), ln1, 1e-5)
            q, k, v = (x @ qkv_w.t()).split((q_width, kv_width, kv_width), dim=-1)
            q = self._rope(q.view(-1, s.heads, s.head_dim), positions)
            k = self._rope(k.view(-1, s.kv_heads, s.head_dim), positions)
            attn = attend(index, q, k, v.view(-1, s.kv_heads, s.head_dim))
            hidden = hidden + attn.reshape(-1, q_width) @ o_w.t()
            x = f.rms_norm(hidden, (s.hidden,), ln2, 1e-5)
            gate, up = (x @ gate_up_w.t()).chunk(2, dim=-1)
            hidden = hidden + (f.silu(gate) * up) @ down_w.t()
        last = f.rms_norm(hidden[last_rows], (s.hidden,), self.norm, 1e-5)
        return (last @ self.lm_head.t()).argmax(-1)


def _empty_cache(torch: Any) -> None:
    if _DEVICE[0] == "cuda":
        torch.cuda.empty_cache()


def _sync(torch: Any) -> None:
    if _DEVICE[0] == "cuda":
        torch.cuda.synchronize()


def _time_graph(torch: Any, step: Callable[[], Any], replays: int) -> float:
    """Seconds of GPU time one replay of ``step`` captured as a CUDA graph takes (median of runs)."""
    if _DEVICE[0] != "cuda":
        return _time_eager(torch, step, 1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside the graph (allocator, kernel selection)
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / replays)
    del graph
    return float(sorted(times)[1])


def _time_eager(torch: Any, step: Callable[[], Any], runs: int) -> float:
    """Wall seconds of one eager ``step`` from launch to its last kernel (median of ``runs``)."""
    step()
    _sync(torch)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        step()
        _sync(torch)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _prefill_grid(light: bool, quick: bool) -> list[list[tuple[int, int]]]:
    """Batches to time: each a list of (new tokens L, cached P) per request."""
    if quick:
        return [[(16, 0)], [(64, 0)], [(64, 128)], [(32, 0), (32, 0)]]
    lengths = [1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192] + ([] if light else [16384])
    grid: list[list[tuple[int, int]]] = [[(n, 0)] for n in lengths]
    cached = [4096, 16384] if light else [1024, 4096, 16384, 32768]
    for p in cached:
        for n in [64, 512, 2048] + ([] if light else [8192]):
            grid.append([(n, p)])
    if not light:
        for count in (2, 4, 8):
            for n in (64, 256, 1024):
                grid.append([(n, 0)] * count)
        grid.append([(512, 4096)] * 4)
    return grid


def _decode_grid(light: bool, quick: bool) -> list[tuple[int, int]]:
    """(batch B, KV tokens per sequence c) pairs to time, B x c within the KV buffer."""
    if quick:
        return [(1, 64), (4, 128)]
    batches = [1, 8, 32, 128] if light else [1, 2, 4, 8, 16, 32, 64, 128, 256]
    contexts = [1024, 4096] if light else [256, 1024, 4096, 16384]
    return [(b, c) for b in batches for c in contexts if b * c <= _DECODE_KV_TOKENS]


_DECODE_KV_TOKENS = 262_144


def _measure_model(
    torch: Any,
    shape: ModelShape,
    entry: dict[str, Any],
    save: Callable[[], None],
    *,
    quick: bool,
    light: bool,
) -> None:
    prefill_grid, decode_grid = _prefill_grid(light, quick), _decode_grid(light, quick)
    max_new = max(sum(n for n, _ in batch) for batch in prefill_grid)
    max_cached = max(p for batch in prefill_grid for _, p in batch)
    positions_needed = max(max_new + max_cached, *(c for _, c in decode_grid)) + 1
    started = time.monotonic()
    model = _Model(torch, shape, positions_needed)
    _sync(torch)
    entry["build_s"] = round(time.monotonic() - started, 1)
    print(f"{shape.name}: weights built in {entry['build_s']} s", flush=True)
    bf16, kvh, dim = torch.bfloat16, shape.kv_heads, shape.head_dim

    # Prefill: a cached prefix per layer (random K/V, as if an earlier request left it) plus room for
    # the new tokens, which each forward writes behind the prefix before attending.
    cache_len = max_cached + max(n for batch in prefill_grid for n, _ in batch)
    cache = [
        (
            torch.randn(1, kvh, cache_len, dim, device=_DEVICE[0], dtype=bf16),
            torch.randn(1, kvh, cache_len, dim, device=_DEVICE[0], dtype=bf16),
        )
        for _ in range(shape.layers)
    ]
    for batch in prefill_grid:
        total = sum(n for n, _ in batch)
        tokens = torch.randint(0, shape.vocab, (total,), device=_DEVICE[0])
        positions = torch.cat([torch.arange(p, p + n, device=_DEVICE[0]) for n, p in batch])
        bounds = []
        offset = 0
        for n, p in batch:
            bounds.append((offset, n, p))
            offset += n
        last_rows = torch.tensor([o + n - 1 for o, n, _ in bounds], device=_DEVICE[0])

        def attend(layer: int, q: Any, k: Any, v: Any, bounds: list[tuple[int, int, int]] = bounds) -> Any:
            outs = []
            k_cache, v_cache = cache[layer]
            for o, n, p in bounds:  # each request its own prefix (they share one buffer: timing only)
                k_cache[0, :, p : p + n].copy_(k[o : o + n].transpose(0, 1))
                v_cache[0, :, p : p + n].copy_(v[o : o + n].transpose(0, 1))
                qr = q[o : o + n].transpose(0, 1).unsqueeze(0)
                out = _prefill_attention(torch, qr, k_cache[:, :, : p + n], v_cache[:, :, : p + n], p)
                outs.append(out[0].transpose(0, 1))
            return outs[0] if len(outs) == 1 else torch.cat(outs)

        def step(tokens: Any = tokens, positions: Any = positions, attend: Any = attend, last: Any = last_rows) -> Any:
            return model.forward(tokens, positions, attend, last)

        big = total * shape.layers >= 8192 * 32
        point = {
            "chunks": [[n, p] for n, p in batch],
            "graph_s": _time_graph(torch, step, 2 if big else 5),
            "eager_s": _time_eager(torch, step, 3),
        }
        entry["prefill"].append(point)
        print(f"{shape.name} prefill {batch[0]} x{len(batch)}: {point}", flush=True)
        save()
    cache.clear()
    _empty_cache(torch)

    # Decode: one flat K and V buffer per layer, viewed as (B, KV heads, c, D) for each point.
    flat = [
        (
            torch.randn(_DECODE_KV_TOKENS * kvh * dim, device=_DEVICE[0], dtype=bf16),
            torch.randn(_DECODE_KV_TOKENS * kvh * dim, device=_DEVICE[0], dtype=bf16),
        )
        for _ in range(shape.layers)
    ]
    for batch_size, context in decode_grid:
        tokens = torch.randint(0, shape.vocab, (batch_size,), device=_DEVICE[0])
        positions = torch.full((batch_size,), context - 1, device=_DEVICE[0])
        rows = torch.arange(batch_size, device=_DEVICE[0])
        views = [
            (
                k[: batch_size * kvh * context * dim].view(batch_size, kvh, context, dim),
                v[: batch_size * kvh * context * dim].view(batch_size, kvh, context, dim),
            )
            for k, v in flat
        ]

        def attend_decode(layer: int, q: Any, k: Any, v: Any, views: Any = views, context: int = context) -> Any:
            k_all, v_all = views[layer]
            k_all[:, :, context - 1].copy_(k)
            v_all[:, :, context - 1].copy_(v)
            return _decode_attention(torch, q.unsqueeze(2), k_all, v_all).squeeze(2)

        def decode_step(
            tokens: Any = tokens, positions: Any = positions, rows: Any = rows, a: Any = attend_decode
        ) -> Any:
            return model.forward(tokens, positions, a, rows)

        point = {
            "batch": batch_size,
            "context_per_seq": context,
            "context_tokens": batch_size * context,
            "graph_s": _time_graph(torch, decode_step, 10),
        }
        entry["decode"].append(point)
        print(f"{shape.name} decode: {point}", flush=True)
        save()
    flat.clear()
    _empty_cache(torch)


# ----------------------------------------------------------------------------------------- fitting


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


def _fit(args: argparse.Namespace) -> int:
    try:
        with open(args.file) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        print(f"gpu_timing fit: cannot read {args.file}: {exc}", file=sys.stderr)
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gpu_timing",
        description="Measure the simulated worker's timing constants on a CUDA GPU, or fit them from a measurement.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    measure = sub.add_parser("measure", help="time prefill and decode of Llama-shaped models (needs PyTorch + CUDA)")
    measure.add_argument("--out", required=True, help="JSON file to write (rewritten after every point)")
    measure.add_argument(
        "--models",
        default="llama-3.1-8b,llama-3.1-70b-tp4-shard",
        help=f"comma-separated shapes, in order: {', '.join(SHAPES)}",
    )
    measure.add_argument("--budget-s", type=float, default=200.0, help="start no further model after this many seconds")
    measure.add_argument("--quick", action="store_true", help="a few tiny points only (checks the script runs)")
    measure.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu: check the script without a GPU (eager only)"
    )
    fit = sub.add_parser("fit", help="fit c0/a/b and d0/d1/d2 from a measure JSON and print each point's error")
    fit.add_argument("file", help="JSON written by measure")
    args = parser.parse_args(argv)
    if args.command == "measure":
        unknown = [m for m in args.models.split(",") if m not in SHAPES]
        if unknown:
            parser.error(f"unknown model shape(s) {', '.join(unknown)}; choose from {', '.join(SHAPES)}")
        return _measure(args)
    return _fit(args)


if __name__ == "__main__":
    sys.exit(main())
