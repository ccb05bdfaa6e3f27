"""Prompt preparation: a parsed request -> the worker's token ids -> block keys, off the event loop.

This is the CPU-heavy, state-free half of a routing decision: render the chat template, tokenize
exactly as the worker will, and hash the key chain of every (page size, model) the candidates
need. It reads nothing the event loop mutates (tokenizers, the piece cache and the key cache are
thread-safe), so the router can run it in its tokenize threads; the index and the policy are only
touched afterwards, on the loop.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from extproc.config import ModelConfig
from extproc.decision.key_cache import KeyCache
from extproc.decision.request import ParsedRequest
from extproc.fleet.blocks import chain_seed
from prefix_common.tokenization import ModelTokenizer, load_tokenizer

__all__ = ["INLINE_TOKENS", "Chain", "PreparedPrompt", "PromptPreparer"]

# Client-given token ids shorter than this are hashed on the loop (~50 us): a thread hop costs more.
INLINE_TOKENS = 2048

Chain = tuple[int, str]  # (block size, model): workers sharing both share one key chain


@dataclass
class PreparedPrompt:
    """Token ids, rendered text and key chains of one request, or why it could not be tokenized."""

    tokens: Sequence[int] | None = None  # an array("I") when tokenized here, the request's list for input_ids
    text: str = ""
    keys: dict[Chain, list[int]] = field(default_factory=dict)
    error: str | None = None


class PromptPreparer:
    """Renders, tokenizes and hashes prompts as the workers do; what it computes depends on the policy."""

    def __init__(
        self,
        models: Collection[ModelConfig],
        key_cache: KeyCache,
        max_lookup_blocks: int,
        needs_tokens: bool,
        needs_text: bool,
    ) -> None:
        self._models = {m.name: m for m in models}
        self._key_cache = key_cache
        self._max_lookup_blocks = max_lookup_blocks
        self.needs_tokens = needs_tokens
        self.needs_text = needs_text
        self._tokenizers: list[ModelTokenizer] = []

    @property
    def key_cache_bytes(self) -> int:
        """Bytes the block-key cache holds now."""
        return self._key_cache.bytes

    @property
    def piece_cache_bytes(self) -> int:
        """Bytes the piece caches of the tokenizers given a share (``share_piece_cache``) hold now."""
        return sum(t.cache_stats["bytes"] for t in self._tokenizers)

    def share_piece_cache(self, total_bytes: int) -> None:
        """Split ``total_bytes`` evenly between the piece caches of the tokenizers this preparer uses."""
        tokenizers = [self.tokenizer_for(name) for name in self._models] or [self.tokenizer_for(None)]
        if self.tokenizer_for(None) not in tokenizers:
            tokenizers.append(self.tokenizer_for(None))
        for tokenizer in tokenizers:
            tokenizer.set_cache_bytes(total_bytes // len(tokenizers))
        self._tokenizers = tokenizers

    def model_config(self, model: str | None) -> ModelConfig | None:
        return self._models.get(model or "")

    def tokenizer_for(self, model: str | None) -> ModelTokenizer:
        """The model's configured tokenizer; models without a config use the built-in default."""
        cfg = self._models.get(model or "")
        if cfg is None:
            return load_tokenizer()
        return load_tokenizer(cfg.tokenizer, cfg.chat_template)

    def prepare(
        self,
        parsed: ParsedRequest,
        chains: Collection[Chain],
        budget: int | None = None,
    ) -> PreparedPrompt | None:
        """Render, tokenize and hash; with a ``budget`` (characters that may miss the piece cache)
        returns None rather than do more work than that, and the caller goes to a thread."""
        prompt = PreparedPrompt()
        if not (self.needs_tokens or self.needs_text):
            return prompt
        try:
            result = self._tokens(parsed, budget)
        except Exception as exc:  # a template that refuses the conversation must not lose the request
            prompt.error = str(exc)
            return prompt
        if result is None:
            return None
        prompt.tokens, prompt.text = result
        if prompt.tokens is not None and self.needs_tokens:
            for chain in chains:
                prompt.keys[chain] = self.chain(parsed, prompt.tokens, chain)
        return prompt

    def chain(self, parsed: ParsedRequest, tokens: Sequence[int], chain: Chain) -> list[int]:
        """The block keys of ``tokens`` for one (block size, model) chain, in the request's namespace."""
        size, model = chain
        return self._key_cache.keys(
            tokens, size, chain_seed(model, parsed.lora, parsed.cache_salt), limit=self._max_lookup_blocks
        )

    def _tokens(self, parsed: ParsedRequest, budget: int | None) -> tuple[Sequence[int] | None, str] | None:
        """Token ids exactly as the worker will build them (and the rendered text for text policies)."""
        if parsed.input_ids is not None:
            if budget is not None and self.needs_tokens and len(parsed.input_ids) >= INLINE_TOKENS:
                return None
            return list(parsed.input_ids), parsed.prompt_text or ""
        tokenizer = self.tokenizer_for(parsed.model)
        if parsed.kind == "chat" and parsed.messages is not None:
            kwargs = dict(parsed.chat_template_kwargs or {})
            generation = bool(kwargs.pop("add_generation_prompt", True))
            text = tokenizer.render_chat(parsed.messages, parsed.tools, generation, **kwargs)
            special = False  # the template wrote the special tokens
        else:
            text, special = parsed.prompt_text or "", True
        if not self.needs_tokens:
            return None, text
        tokens = tokenizer.encode_ids(text, special, budget)  # None: more than ``budget`` is new (never without one)
        return None if tokens is None else (tokens, text)
