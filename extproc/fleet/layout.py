"""What a decision reads of each worker that changes only when the worker reports itself anew.

Every decision looks at every worker before pruning: its page size (model config, then
``/server_info``, then its KV events), its data-parallel ranks (the index slots it is looked up
under) and its shared storage tier. Read from ``worker.info`` each time, that costs a few
microseconds per worker per decision, i.e. milliseconds on a 256-worker fleet. ``FleetLayout``
keeps those answers per worker and recomputes them when the worker's ``info`` or ``model`` changes
(discovery replaces ``worker.info`` with a new dict on every refresh, so identity says "changed").
Only the event-learnt page size is read live, and only for a worker whose ``/server_info`` and
model config name none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from extproc.config import ModelConfig
from extproc.fleet.index import rank_key
from extproc.fleet.info import dp_size, page_size, storage_group
from extproc.fleet.workers import Worker

__all__ = ["FleetLayout", "WorkerLayout"]


@dataclass(frozen=True, slots=True)
class WorkerLayout:
    """One worker's routing shape, as of its ``info`` and ``model`` then."""

    info: dict[str, Any]  # the ``worker.info`` it was read from (identity marks it stale)
    model: str | None
    configured_block_size: int | None  # from the model config or ``/server_info``; None: learnt from events
    slots: tuple[str, ...]  # index slots of its data-parallel ranks (just its id for one rank)
    storage_group: str | None


class FleetLayout:
    """Per-worker cache of ``WorkerLayout``; ``block_size`` resolves the page size as the router must."""

    def __init__(
        self,
        model_config: Callable[[str | None], ModelConfig | None],
        event_block_size: Callable[[Worker], int | None],
        default_block_size: int,
    ) -> None:
        self._model_config = model_config
        self._event_block_size = event_block_size
        self._default_block_size = default_block_size
        self._layouts: dict[Worker, WorkerLayout] = {}

    def of(self, worker: Worker) -> WorkerLayout:
        """The worker's layout, recomputed if its ``info`` or ``model`` changed since it was read."""
        layout = self._layouts.get(worker)
        if layout is None or layout.info is not worker.info or layout.model != worker.model:
            layout = self._layouts[worker] = self._read(worker)
        return layout

    def block_size(self, worker: Worker) -> int:
        """Tokens per block for this worker: model config, then ``/server_info``, then its events, then the default."""
        return self.of(worker).configured_block_size or self._event_block_size(worker) or self._default_block_size

    def read(self, workers: list[Worker]) -> tuple[list[WorkerLayout], list[int]]:
        """Every worker's layout and block size, in one pass (what a decision reads of the fleet)."""
        cached = self._layouts.get
        learnt = self._event_block_size
        default = self._default_block_size
        shapes: list[WorkerLayout] = []
        sizes: list[int] = []
        for worker in workers:
            layout = cached(worker)
            if layout is None or layout.info is not worker.info or layout.model != worker.model:
                layout = self._layouts[worker] = self._read(worker)
            shapes.append(layout)
            sizes.append(layout.configured_block_size or learnt(worker) or default)
        return shapes, sizes

    def known(self) -> set[Worker]:
        """The workers whose layout is held now."""
        return set(self._layouts)

    def retain(self, workers: list[Worker]) -> None:
        """Forget the layouts of workers no longer in the fleet."""
        current = set(workers)
        for worker in [w for w in self._layouts if w not in current]:
            del self._layouts[worker]

    def _read(self, worker: Worker) -> WorkerLayout:
        cfg = self._model_config(worker.model)
        configured = cfg.block_size if cfg is not None and cfg.block_size else page_size(worker)
        ranks = dp_size(worker)
        slots = (worker.id,) if ranks == 1 else tuple(rank_key(worker.id, r) for r in range(ranks))
        return WorkerLayout(
            info=worker.info,
            model=worker.model,
            configured_block_size=configured,
            slots=slots,
            storage_group=storage_group(worker),
        )
