"""Request -> token ids, exactly as an SGLang worker builds them.

Shared by the router and the simulated worker (``sglang_workers`` imports this module, never the
reverse), so both sides always agree on the ids that prefix blocks are hashed from.

SGLang tokenizes chat requests with the HF tokenizer's ``apply_chat_template(..., tokenize=True,
add_generation_prompt=True)``: the template is rendered with Jinja (sandboxed, ``trim_blocks`` and
``lstrip_blocks``) and the rendered text is encoded *without* adding special tokens (the template
writes them). Text prompts (``/generate`` ``text``, ``/v1/completions`` string prompts) are encoded
with special tokens added. We reproduce that with the ``tokenizers`` library directly, which is much
lighter than ``transformers`` (a test proves the ids identical).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
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


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Same behaviour as transformers' chat-template ``tojson`` filter (not Jinja's HTML-escaping one).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


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


@dataclass(frozen=True)
class ModelTokenizer:
    """A model's tokenizer plus its chat template; cheap to share, safe across threads."""

    name: str
    tokenizer: Tokenizer
    chat_template: str | None
    special_tokens: dict[str, str]

    # -- encoding ---------------------------------------------------------------------------
    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for a raw text prompt, as SGLang encodes ``text`` / completion prompts."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        """The prompt text the chat template renders for ``messages`` (HF semantics)."""
        if self.chat_template is None:
            raise ChatTemplateError(f"tokenizer {self.name!r} has no chat template")
        template = _compile_template(self.chat_template)
        try:
            return template.render(messages=messages, tools=tools,
                                   add_generation_prompt=add_generation_prompt,
                                   **self.special_tokens, **template_kwargs)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
        """Token ids for a chat request, as SGLang builds ``input_ids`` for it."""
        text = self.render_chat(messages, tools, add_generation_prompt, **template_kwargs)
        return self.encode_text(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    @property
    def eos_token_id(self) -> int | None:
        eos = self.special_tokens.get("eos_token")
        return self.tokenizer.token_to_id(eos) if eos else None

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
        special = {key: tok for key in ("bos_token", "eos_token", "pad_token", "unk_token")
                   if (tok := _token_content(config.get(key))) is not None}
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
