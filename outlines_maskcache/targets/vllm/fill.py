"""vLLM fills: each constrained request's int32 bitmask row, served from the cache.

``OutlinesGrammar.fill_bitmask`` runs per constrained request per step in
the EngineCore, and stock's ``write_mask_into`` costs far more than a copy
for a dense state (docs/benchmarks.md).  The row depends only on the
compiled Index and the guide's state, so a hit copies the cached row into
``bitmask[idx]`` through a numpy view; a miss runs stock's write into a
fresh row and caches it.  Any fault runs stock's ``fill_bitmask``, which
overwrites the whole row, so a half-done copy never leaks out.  The rows
served are handed to the apply (:mod:`.apply`) as its hint.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from outlines_maskcache import stats_file
from outlines_maskcache.contract import Patch
from outlines_maskcache.gate import cached_or_stock, when_active
from outlines_maskcache.rows import bitmask_row
from outlines_maskcache.runtime import RUNTIME
from outlines_maskcache.targets.vllm.apply import FILLED_ROWS
from outlines_maskcache.targets.vllm.compile import FINGERPRINT


class BitmaskView:
    """A numpy view of vLLM's (CPU, possibly pinned) int32 bitmask, kept while the tensor is the same.

    Torch indexing costs more than a cache hit should; vLLM fills one bitmask
    per engine every step, so the view is re-made only when the tensor was
    reallocated or reshaped.
    """

    def __init__(self) -> None:
        self._slot: tuple[Any, int, Any, np.ndarray] | None = None

    def of(self, bitmask: Any) -> np.ndarray | None:
        """The view, or None to leave the fill to stock (not a CPU int32 matrix)."""
        slot = self._slot
        if slot is not None and slot[0] is bitmask and slot[1] == bitmask.data_ptr() and slot[2] == bitmask.shape:
            return slot[3]
        import torch

        if bitmask.device.type != "cpu" or bitmask.dtype != torch.int32 or bitmask.dim() != 2:
            return None
        view = bitmask.numpy()
        self._slot = (bitmask, bitmask.data_ptr(), bitmask.shape, view)
        return view

    def clear(self) -> None:
        self._slot = None

    after_fork = clear


VIEWS = RUNTIME.own(BitmaskView())


def patches(grammar_cls: type, backend_cls: type) -> list[Patch]:
    stock_fill = grammar_cls.__dict__["fill_bitmask"]
    stock_destroy = getattr(backend_cls, "destroy", None)

    @when_active(stock_fill)
    def fill_bitmask(self: Any, bitmask: Any, idx: int) -> None:
        fingerprint = getattr(self, FINGERPRINT, None)
        view = VIEWS.of(bitmask) if fingerprint is not None else None
        if view is None:  # compiled while inactive, or a bitmask we do not view
            return stock_fill(self, bitmask, idx)
        stats_file.filled()

        def cached() -> None:
            row = bitmask_row(fingerprint, self.guide, view.shape[1])
            view[idx] = row
            FILLED_ROWS.filled(row)

        cached_or_stock("vllm-v1 fill_bitmask", cached, lambda: stock_fill(self, bitmask, idx))

    found = [Patch(grammar_cls, "fill_bitmask", fill_bitmask)]
    if stock_destroy is not None:  # only the stats file depends on it
        def destroy(self: Any) -> Any:
            # The first step of EngineCore shutdown, after the last fill: exit
            # hooks are no use there, as vLLM force-kills a slow EngineCore.
            stats_file.write_safely()
            return stock_destroy(self)

        found.append(Patch(backend_cls, "destroy", destroy))
    return found
