"""Build the tiny random-weight Llama that real SGLang serves on a CPU (run by ``make sglang-cpu``).

Runs under the SGLang virtualenv's interpreter (it needs torch and transformers, which the project's own
venv does not have), imports nothing from the project, and downloads nothing: the architecture is
written out here, the weights are drawn from a seeded generator, and the tokenizer and chat template are
copied from the directory given (the project's default tokenizer). The model is small enough that a
2-core CPU prefills 512 tokens in well under 0.1 s, so tests and benchmarks run real SGLang in seconds.

    python build_tiny_model.py --tokenizer prefix_common/default_tokenizer --out ~/.cache/.../tiny-llama
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

# The shape of the model: a Llama with grouped-query attention (4 query heads, 2 KV heads), so SGLang's
# Llama code paths (RoPE, GQA, RMSNorm, SwiGLU) all run; 4096 positions bound the context length.
ARCHITECTURE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _special_ids(tokenizer_dir: Path) -> dict[str, int]:
    """bos / eos / pad ids, read from the tokenizer files themselves (no guessing)."""
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in vocab.get("added_tokens", [])}
    ids.update(vocab["model"]["vocab"])
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    out = {}
    for name in ("bos_token", "eos_token", "pad_token"):
        token = config.get(name)
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str) and token in ids:
            out[name] = ids[token]
    out["vocab_size"] = max(ids.values()) + 1
    return out


def build(tokenizer_dir: Path, out: Path, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    special = _special_ids(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=special["vocab_size"],
        bos_token_id=special.get("bos_token"),
        eos_token_id=special.get("eos_token"),
        pad_token_id=special.get("pad_token"),
        dtype="bfloat16",
        **ARCHITECTURE,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    model.save_pretrained(staging)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy2(tokenizer_dir / name, staging / name)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)  # all or nothing: a half-written model is never left where SGLang looks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="Tokenizer directory to copy beside the model.")
    parser.add_argument("--out", type=Path, required=True, help="Model directory to (re)create.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the random weights.")
    args = parser.parse_args()
    if not (args.tokenizer / "tokenizer.json").is_file():
        print(f"build_tiny_model: no tokenizer.json in {args.tokenizer}", file=sys.stderr)
        return 2
    build(args.tokenizer, args.out, args.seed)
    print(f"tiny Llama written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
