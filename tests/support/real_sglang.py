"""Real SGLang CPU workers for the tests marked ``real_sglang``: their settings, an in-place restart, the router's
config for their model and a request it streams."""

from __future__ import annotations

from typing import Any

from sglang_workers.real.installation import TINY_MODEL_NAME, TINY_MODEL_VOCAB, CpuInstall, find_install

__all__ = ["CPU_EXTRA_FLAGS", "CPU_POOL_TOKENS", "restart_cpu_worker", "streamed_chat", "tiny_model_config"]

CPU_POOL_TOKENS = 2048  # the workers' KV pool (--max-total-tokens): small, so a test provokes evictions
CPU_EXTRA_FLAGS = ("--context-length", "4096", "--max-running-requests", "1024")  # as the simulator states them


def restart_cpu_worker(workers: list[Any], index: int, crash: bool = True) -> Any:
    """Kill (SIGKILL, a crash) or stop worker ``index`` and start it again on the same ports."""
    worker = workers[index]
    worker.kill() if crash else worker.stop()
    worker.restart(400)
    return worker


def tiny_model_config(install: CpuInstall | None = None) -> str:
    """The router config's ``models:`` entry for the tiny Llama the CPU workers serve (its tokenizer).

    ``install``: the ``make sglang-cpu`` install (found if not given; the session's workers ran from it).
    """
    install = install or find_install()
    assert install is not None, "no make sglang-cpu install"
    entry = f"  - name: {TINY_MODEL_NAME}\n    tokenizer: {install.model_dir}\n    vocab_size: {TINY_MODEL_VOCAB}\n"
    return "models:\n" + entry


def streamed_chat(content: str, max_tokens: int) -> dict[str, Any]:
    """A streamed chat completion for the tiny Llama that runs to ``max_tokens`` tokens."""
    chat = {"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    return chat | {"ignore_eos": True, "stream": True}
