"""Build the project's built-in default tokenizer (``prefix_common/default_tokenizer/``).

Why: ``prefix-router sim-worker`` and ``prefix-router serve`` must work on a fresh machine with no
network, so the project ships a small but real byte-level BPE tokenizer plus a Llama-3-style chat
template. It is trained here, deterministically, on the docstrings of the running Python's
standard library (text that is on every machine), and the result is committed so that every
install tokenizes identically. Run it again only to change the default on purpose.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

OUT = Path(__file__).resolve().parent.parent / "extproc" / "default_tokenizer"
VOCAB_SIZE = 8192
SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|eom_id|>",
    "<|pad|>",
]
SKIP_PREFIXES = ("this", "antigravity", "test", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "__")


def corpus() -> list[str]:
    texts: list[str] = []
    for info in sorted(pkgutil.iter_modules(), key=lambda m: m.name):
        if info.name.startswith(SKIP_PREFIXES) or info.name not in sys.stdlib_module_names:
            continue
        try:
            module = importlib.import_module(info.name)
        except Exception:
            continue
        for name in sorted(dir(module)):
            doc = getattr(getattr(module, name, None), "__doc__", None)
            if isinstance(doc, str) and len(doc) > 40:
                texts.append(doc)
    return texts


def main() -> None:
    tokenizer = Tokenizer(models.BPE(byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    # Like Llama 3: plain encodes (completions) start with <|begin_of_text|>.
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", tokenizer.token_to_id("<|begin_of_text|>"))],
    )
    OUT.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(OUT / "tokenizer.json"))
    template = (OUT / "chat_template.jinja").read_text()
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "pad_token": "<|pad|>",
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "chat_template": template,
    }
    (OUT / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {OUT} (vocab {tokenizer.get_vocab_size()})")


if __name__ == "__main__":
    main()
