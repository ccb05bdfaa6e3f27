"""Request -> token ids, exactly as an SGLang worker builds them.

Shared by the router and the simulated worker (``sglang_workers`` imports this module, never the
reverse), so both sides always agree on the ids that prefix blocks are hashed from.

SGLang tokenizes chat requests with the HF tokenizer's ``apply_chat_template(..., tokenize=True,
add_generation_prompt=True)``: the template is rendered with Jinja (sandboxed, ``trim_blocks`` and
``lstrip_blocks``) and the rendered text is encoded *without* adding special tokens (the template
writes them). Text prompts (``/generate`` ``text``, ``/v1/completions`` string prompts) are encoded
with special tokens added. We reproduce that with the ``tokenizers`` library directly, which is much
lighter than ``transformers`` (a test proves the ids identical).

Long prompts repeat: system prompts, tool lists, documents, earlier turns. Encoding is split into
pieces whose tokens provably do not depend on their neighbours, and each piece's ids are cached:

- at added tokens (``<|eot_id|>`` ...): the tokenizer itself splits them out before anything else
  runs, so the text between two of them is always encoded on its own;
- inside long text, before a paragraph break (``\n\n``) that follows a letter or digit: with a
  byte-level pre-tokenizer (GPT-2, Llama-3, Qwen regexes) no pre-token can span that boundary and
  the regex restarts there, so both sides encode exactly as they do within the whole.

Only tokenizers where both rules hold (no normalizer, byte-level pre-tokenizer without prefix
space) use the cache; others are encoded whole. Tests compare against whole-text encoding and
against ``transformers`` over many random conversations.
"""

from __future__ import annotations

import json
import re
import threading
import unicodedata
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

__all__ = [
    "DEFAULT_TOKENIZER_DIR",
    "ChatTemplateError",
    "ModelTokenizer",
    "TokenizerLoadError",
    "load_tokenizer",
]

DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parent / "default_tokenizer"


class TokenizerLoadError(Exception):
    """The tokenizer or its chat template could not be loaded (bad path, bad file)."""


class ChatTemplateError(ValueError):
    """The chat template refused the conversation (e.g. ``raise_exception`` in the template)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Same behaviour as transformers' chat-template ``tojson`` filter (not Jinja's HTML-escaping one).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


_LETTER_OR_DIGIT = frozenset(("Lu", "Ll", "Lt", "Lm", "Lo", "Nd", "Nl", "No"))
_MIN_CACHED_PIECE = 16  # shorter pieces are cheaper to encode than to look up
_NO_IDS: array[int] = array("I")  # placeholder of a piece being encoded
_PARALLEL_CHARS = 8192  # less new text than this is encoded on the calling thread, not in rayon's pool


# Cached ids are kept as ``array("I")`` (tokenizers' ids are u32): 4 B a token where a list of ints
# takes 36 (an int object and its slot), so the same share of the budget holds 5-9x more text, and
# the router hashes them as they are (extproc/decision/key_cache.py) without converting a list again.
_ID_BYTES = 4  # one cached token id in an array("I")
_PIECE_BYTES = 200  # per cached piece: the dict entry, the str and array headers (tracemalloc: ~150 + str)


def _piece_cost(piece: str, ids: array[int]) -> int:
    return len(piece) + _ID_BYTES * len(ids) + _PIECE_BYTES


class _PieceCache:
    """LRU of text piece -> token ids (``array("I")``), bounded by the bytes it takes (text and ids)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.chars = 0
        self.hits = 0
        self.misses = 0
        self._items: OrderedDict[str, array[int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, piece: str) -> array[int] | None:
        with self._lock:
            ids = self._items.get(piece)
            if ids is None:
                self.misses += 1
                return None
            self._items.move_to_end(piece)
            self.hits += 1
            return ids

    def put(self, piece: str, ids: array[int]) -> None:
        cost = _piece_cost(piece, ids)
        if cost > self.max_bytes:
            return
        with self._lock:
            if piece in self._items:
                return
            self._items[piece] = ids
            self.bytes += cost
            self.chars += len(piece)
            while self.bytes > self.max_bytes:
                old, old_ids = self._items.popitem(last=False)
                self.bytes -= _piece_cost(old, old_ids)
                self.chars -= len(old)

    def resize(self, max_bytes: int) -> None:
        with self._lock:
            self.max_bytes = max_bytes
            while self.bytes > self.max_bytes and self._items:
                old, old_ids = self._items.popitem(last=False)
                self.bytes -= _piece_cost(old, old_ids)
                self.chars -= len(old)


def _paragraph_pieces(text: str) -> list[str]:
    """Split before each ``\n\n`` that follows a letter or digit (a boundary no pre-token spans)."""
    pieces = []
    start = 0
    find = text.find
    pos = find("\n\n", 1)
    while pos != -1:
        if pos - start >= _MIN_CACHED_PIECE and unicodedata.category(text[pos - 1]) in _LETTER_OR_DIGIT:
            pieces.append(text[start:pos])
            start = pos
        pos = find("\n\n", pos + 2)
    pieces.append(text[start:])
    return pieces


@dataclass(frozen=True)
class ModelTokenizer:
    """A model's tokenizer plus its chat template; cheap to share, safe across threads."""

    name: str
    tokenizer: Tokenizer
    chat_template: str | None
    special_tokens: dict[str, str]
    cache_bytes: int = 64 * 1024 * 1024  # the router sets its share of memory.budget_bytes (set_cache_bytes)
    _cache: _PieceCache = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_cache", _PieceCache(self.cache_bytes))

    def set_cache_bytes(self, max_bytes: int) -> None:
        """Bound the piece cache (oldest pieces dropped at once if it holds more)."""
        self._cache.resize(max_bytes)

    # -- encoding ---------------------------------------------------------------------------
    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for a raw text prompt, as SGLang encodes ``text`` / completion prompts."""
        if self._splitter is None:
            return self.encode_whole(text, add_special_tokens)
        ids = self.encode_ids(text, add_special_tokens)
        assert ids is not None  # no budget, so never refused
        return ids.tolist()

    def encode_ids(
        self, text: str, add_special_tokens: bool = True, max_uncached_chars: int | None = None
    ) -> array[int] | None:
        """``encode_text`` as an ``array("I")``: what the router keeps and hashes (no list of ints built).

        With ``max_uncached_chars``, None (having encoded nothing) when more of ``text`` than that
        misses the piece cache: lets a caller on an event loop do the cheap, warm case in place and
        hand a cold prompt to a thread.
        """
        if self._splitter is None:
            if max_uncached_chars is not None and len(text) > max_uncached_chars:
                return None
            return array("I", self.encode_whole(text, add_special_tokens))
        ids = self._encode_pieces(text, max_uncached_chars)
        if ids is None or not add_special_tokens:
            return ids
        prefix, suffix = self._special_affixes
        return array("I", prefix) + ids + array("I", suffix) if prefix or suffix else ids

    def encode_whole(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` encoded in one call, without the piece cache (the reference)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    @property
    def cache_stats(self) -> dict[str, int]:
        cache = self._cache
        return {"hits": cache.hits, "misses": cache.misses, "chars": cache.chars, "bytes": cache.bytes}

    @cached_property
    def _splitter(self) -> tuple[re.Pattern[str], dict[str, int]] | None:
        """Added-token pattern and ids when piecewise encoding is provably identical, else None."""
        try:
            spec = json.loads(self.tokenizer.to_str())
        except ValueError:
            return None
        pre = spec.get("pre_tokenizer") or {}
        parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        byte_level = [p for p in parts if p.get("type") == "ByteLevel"]
        if (
            spec.get("normalizer") is not None
            or not byte_level
            or any(p.get("add_prefix_space") for p in byte_level)
            or any(p.get("type") not in ("ByteLevel", "Split") for p in parts)
        ):
            return None
        added = {}
        for token in spec.get("added_tokens", []):
            if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
                return None
            added[token["content"]] = token["id"]
        if not added:
            return re.compile(r"(?!x)x"), added
        pattern = "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True))
        return re.compile(f"({pattern})"), added

    @cached_property
    def _special_affixes(self) -> tuple[list[int], list[int]]:
        """What the post-processor adds around a single sequence (e.g. ``<|begin_of_text|>``)."""
        probe = "probe"
        bare = self.tokenizer.encode(probe, add_special_tokens=False).ids
        full = self.tokenizer.encode(probe, add_special_tokens=True).ids
        for i in range(len(full) - len(bare) + 1):
            if full[i : i + len(bare)] == bare:
                return full[:i], full[i + len(bare) :]
        raise TokenizerLoadError(f"tokenizer {self.name!r}: cannot locate special tokens around a sequence")

    def _encode_pieces(self, text: str, max_uncached_chars: int | None = None) -> array[int] | None:
        assert self._splitter is not None
        pattern, added = self._splitter
        plan: list[str | int] = []
        for part in pattern.split(text):
            if not part:
                continue
            token = added.get(part)
            if token is not None:
                plan.append(token)
            elif len(part) >= 2 * _MIN_CACHED_PIECE:
                plan.extend(_paragraph_pieces(part))
            else:
                plan.append(part)
        cache = self._cache
        found: dict[str, array[int]] = {}
        missing: list[str] = []
        new_chars = 0
        for item in plan:
            if isinstance(item, str) and item not in found:
                ids = cache.get(item) if len(item) >= _MIN_CACHED_PIECE else None
                if ids is None:
                    new_chars += len(item)
                    if max_uncached_chars is not None and new_chars > max_uncached_chars:
                        return None  # more is new than the caller wants done here
                    missing.append(item)
                    found[item] = _NO_IDS
                else:
                    found[item] = ids
        if missing:
            tokenizer = self.tokenizer
            if len(missing) > 1 and new_chars > _PARALLEL_CHARS:
                encodings = tokenizer.encode_batch(missing, add_special_tokens=False)  # in parallel (rayon)
            else:  # waking the rayon pool costs more than encoding a little text here
                encodings = [tokenizer.encode(piece, add_special_tokens=False) for piece in missing]
            for piece, encoding in zip(missing, encodings):
                ids = found[piece] = array("I", encoding.ids)
                if len(piece) >= _MIN_CACHED_PIECE:
                    cache.put(piece, ids)
        out = array("I")
        for item in plan:
            if isinstance(item, int):
                out.append(item)
            else:
                out.extend(found[item])  # a copy of the bytes, not of int objects
        return out

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text the chat template renders for ``messages`` (HF semantics)."""
        if self.chat_template is None:
            raise ChatTemplateError(f"tokenizer {self.name!r} has no chat template")
        template = _compile_template(self.chat_template)
        try:
            return template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
                **template_kwargs,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids for a chat request, as SGLang builds ``input_ids`` for it."""
        text = self.render_chat(messages, tools, add_generation_prompt, **template_kwargs)
        return self.encode_text(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- loading ----------------------------------------------------------------------------
    @classmethod
    def from_path(cls, path: str | Path | None, chat_template: str | Path | None = None) -> ModelTokenizer:
        """Load from a HF model directory, a ``tokenizer.json`` file, or ``None`` for the built-in default.

        The chat template comes from ``chat_template`` (a file or a literal template), else from
        ``chat_template.jinja`` / ``tokenizer_config.json`` beside the tokenizer.
        """
        base = Path(path) if path is not None else DEFAULT_TOKENIZER_DIR
        tokenizer_file = base / "tokenizer.json" if base.is_dir() else base
        if not tokenizer_file.is_file():
            raise TokenizerLoadError(f"no tokenizer.json at {base}")
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the tokenizers library raises plain Exception subclasses
            raise TokenizerLoadError(f"cannot read {tokenizer_file}: {exc}") from exc
        folder = tokenizer_file.parent
        config: dict[str, Any] = {}
        config_file = folder / "tokenizer_config.json"
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text())
            except ValueError as exc:
                raise TokenizerLoadError(f"cannot parse {config_file}: {exc}") from exc
        template = _load_template(chat_template, folder, config)
        special = {
            key: tok
            for key in ("bos_token", "eos_token", "pad_token", "unk_token")
            if (tok := _token_content(config.get(key))) is not None
        }
        name = "default" if path is None else str(path)
        return cls(name=name, tokenizer=tokenizer, chat_template=template, special_tokens=special)


def _load_template(explicit: str | Path | None, folder: Path, config: dict[str, Any]) -> str | None:
    if explicit is not None:
        candidate = Path(explicit)
        if len(str(explicit)) < 4096 and candidate.is_file():
            return candidate.read_text()
        return str(explicit)
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: HF uses the one called "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


@lru_cache(maxsize=16)
def load_tokenizer(path: str | None = None, chat_template: str | None = None) -> ModelTokenizer:
    """Process-wide cache of loaded tokenizers (loading a large ``tokenizer.json`` takes ~1 s)."""
    return ModelTokenizer.from_path(path, chat_template)
