"""Router token ids == what SGLang builds (transformers' apply_chat_template), and the piece cache
never changes a single id (property-style over random prompts)."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from prefix_common.tokenization import DEFAULT_TOKENIZER_DIR, ModelTokenizer, load_tokenizer

transformers = pytest.importorskip("transformers", reason="transformers is the reference implementation")

CHATML = (
    "{%- if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_ALPHABET = string.ascii_letters + string.digits + "     .,;:!?'\"()-_/\\{}[]<>#@$%^&*+=~`|" + "éüñß中文日本語😀"


def _text(rng: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.08:
            out.append(rng.choice(["\n\n", "\n", "\r\n", "  \n\n", "\n\n\n", "\t"]))
        elif r < 0.12:
            out.append(str(rng.randint(0, 10**6)))
        elif r < 0.14:
            out.append(rng.choice(["<|eot_id|>", "<|start_header_id|>", "<|im_end|>", "<|im_start|>"]))
        else:
            out.append("".join(rng.choice(_ALPHABET) for _ in range(rng.randint(1, 12))))
        if rng.random() < 0.6:
            out.append(" ")
    return "".join(out)


def _conversation(rng: random.Random, shared: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.7:
        messages.append({"role": "system", "content": rng.choice(shared)})
    for turn in range(rng.randint(1, 4)):
        content = rng.choice(shared) + _text(rng, 20) if rng.random() < 0.5 else _text(rng, rng.randint(1, 80))
        messages.append({"role": "user", "content": content})
        if turn < 3 and rng.random() < 0.6:
            messages.append({"role": "assistant", "content": _text(rng, rng.randint(1, 30))})
    if messages[-1]["role"] == "assistant":
        messages.append({"role": "user", "content": "and?"})
    tools = None
    if rng.random() < 0.3:
        tools = [
            {
                "type": "function",
                "function": {
                    "name": f"tool_{i}",
                    "description": _text(rng, 8),
                    "parameters": {"type": "object", "properties": {}},
                },
            }
            for i in range(rng.randint(1, 3))
        ]
    return messages, tools


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second tokenizer, built here: Llama-3 split regex + byte-level BPE, ChatML template."""
    rng = random.Random(7)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=800,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_text(rng, 200) for _ in range(200)], trainer)
    folder = tmp_path_factory.mktemp("chatml")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHATML,
            }
        )
    )
    return folder


def _reference(folder: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize("which", ["default", "chatml"])
def test_chat_ids_equal_transformers_apply_chat_template(which: str, chatml_dir: Path) -> None:
    folder = DEFAULT_TOKENIZER_DIR if which == "default" else chatml_dir
    ours = load_tokenizer(None if which == "default" else str(folder))
    assert ours._splitter is not None  # the piece cache is in use for both
    ref = _reference(folder)
    rng = random.Random(11)
    shared = [_text(rng, 300) for _ in range(4)]  # long repeated pieces: system prompts, documents
    for _ in range(120):
        messages, tools = _conversation(rng, shared)
        expected = ref.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
        if not isinstance(expected, list):  # newer transformers return a BatchEncoding
            expected = expected["input_ids"]
        assert ours.encode_chat(messages, tools) == list(expected)
    assert ours.cache_stats["hits"] > 0


@pytest.mark.parametrize("which", ["default", "chatml"])
def test_piece_cache_equals_whole_text_encoding(which: str, chatml_dir: Path) -> None:
    tok = load_tokenizer(None if which == "default" else str(chatml_dir))
    fresh = ModelTokenizer(tok.name, tok.tokenizer, tok.chat_template, tok.special_tokens)
    rng = random.Random(3)
    pieces = [_text(rng, rng.randint(50, 400)) for _ in range(6)]
    for _ in range(300):
        text = "".join(
            rng.choice(pieces) if rng.random() < 0.5 else _text(rng, rng.randint(0, 60))
            for _ in range(rng.randint(1, 6))
        )
        for special in (False, True):
            assert fresh.encode_text(text, special) == fresh.encode_whole(text, special), text[:200]
    assert fresh.cache_stats["hits"] > 100


def test_encode_ids_is_exact_within_its_budget_and_refuses_beyond() -> None:
    tok = load_tokenizer()
    fresh = ModelTokenizer(tok.name, tok.tokenizer, tok.chat_template, tok.special_tokens)
    rng = random.Random(11)
    document = "<|eot_id|>".join(_text(rng, 1500) for _ in range(2))  # kilobytes, special tokens inside

    def new_text(chars: int) -> str:
        return "".join(rng.choice(_ALPHABET) for _ in range(chars))

    assert fresh.encode_ids(document, False, 1000) is None  # all of it new: refused, nothing cached
    assert fresh.cache_stats["chars"] == 0
    fresh.encode_text(document, False)  # now cached
    for _ in range(20):
        text = document + "<|eot_id|>" + new_text(rng.randint(0, 900))  # a new turn after the document
        for special in (False, True):
            ids = fresh.encode_ids(text, special, 1000)
            assert ids is not None and ids.typecode == "I" and ids.tolist() == fresh.encode_whole(text, special)
        assert fresh.encode_ids(text + "<|eot_id|>" + new_text(1200), False, 1000) is None


def test_completion_prompts_match_transformers() -> None:
    ours = load_tokenizer()
    ref = _reference(DEFAULT_TOKENIZER_DIR)
    rng = random.Random(5)
    for _ in range(50):
        text = _text(rng, rng.randint(1, 200))
        assert ours.encode_text(text) == ref(text)["input_ids"]


def test_tokenizer_with_a_normalizer_is_encoded_whole(tmp_path: Path) -> None:
    tok = Tokenizer.from_file(str(DEFAULT_TOKENIZER_DIR / "tokenizer.json"))
    from tokenizers import normalizers

    tok.normalizer = normalizers.Lowercase()
    tok.save(str(tmp_path / "tokenizer.json"))
    ours = ModelTokenizer.from_path(tmp_path)
    assert ours._splitter is None  # splitting could change ids: not used
    assert ours.encode_text("Hello\n\nWorld") == tok.encode("Hello\n\nWorld").ids


def test_router_uses_each_models_own_tokenizer(chatml_dir: Path) -> None:
    from extproc.config import ModelConfig, RouterConfig
    from extproc.decision.request import ParsedRequest
    from extproc.fleet.workers import Worker, WorkerRegistry
    from extproc.serving.app import RouterApp

    config = RouterConfig(models=[ModelConfig(name="small-chatml", tokenizer=str(chatml_dir))])
    workers = [Worker(id="w", url="http://127.0.0.1:1", ip="127.0.0.1", port=1)]
    app = RouterApp(config, WorkerRegistry(workers))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there\n\nfriend"}]
    for model, folder in (("small-chatml", chatml_dir), ("anything-else", DEFAULT_TOKENIZER_DIR)):
        outcome = app.router.route(
            ParsedRequest(path="/v1/chat/completions", kind="chat", model=model, messages=messages)
        )
        app.router.finish(outcome)
        expected = _reference(folder).apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(expected, list):
            expected = expected["input_ids"]
        assert list(outcome.request.token_ids or []) == list(expected), model
