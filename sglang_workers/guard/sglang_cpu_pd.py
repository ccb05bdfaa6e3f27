"""The one runtime adjustment real SGLang 0.5.23 needs to run a prefill/decode pair on a CPU.

On the first PD request SGLang's prefill scheduler takes a path enabled by
``MooncakeKVSender.supports_host_tensor_indices = True`` that calls ``torch.empty(..., pin_memory=True)`` and
``torch.cuda.Event()`` (``disaggregation/prefill.py``, ~line 1753): both need CUDA. With the attribute False it
sends the KV indices the ordinary way, which works on a CPU. ``sitecustomize`` installs this import hook in a
worker's processes when ``PREFIX_ROUTER_SGLANG_CPU_PD`` is set (``sglang_workers.real.cpu_launch`` sets it for
PD workers only); the hook sets the attribute as soon as ``sglang.srt.disaggregation.mooncake.conn`` has been
imported, and stops the import with a clear error when the attribute is gone (another SGLang than 0.5.23).
Standard library only: this runs under SGLang's own virtualenv.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

TARGET_MODULE = "sglang.srt.disaggregation.mooncake.conn"
ATTRIBUTE = "supports_host_tensor_indices"


def adjust(module: ModuleType) -> None:
    """Turn the CUDA-only host-tensor path off on Mooncake's KV sender (pinned to SGLang 0.5.23)."""
    sender = getattr(module, "MooncakeKVSender", None)
    if sender is None or ATTRIBUTE not in vars(sender):
        raise ImportError(
            f"prefix-router's CPU PD adjustment: {TARGET_MODULE}.MooncakeKVSender.{ATTRIBUTE} is gone; it was written "
            "for SGLang 0.5.23 (run `make sglang-cpu`, which pins it)"
        )
    sender.supports_host_tensor_indices = False


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        result: ModuleType | None = self.inner.create_module(spec)
        return result

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        adjust(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of one module, so the adjustment runs right after that module's own code."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Adjust the module now if it is already imported, else when it is."""
    if TARGET_MODULE in sys.modules:
        adjust(sys.modules[TARGET_MODULE])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
