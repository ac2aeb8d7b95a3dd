"""Numpy kernel (llama.cpp, and outlines' numpy tensor adapter).

The torch CPU kernel's ``bound``, ``blocked`` and sparse forms, written into
the caller's array (llama.cpp's strided float32 view of its candidates),
plus :class:`BlockedIds` for states that block few tokens (inside a JSON
string): -inf written at those ids alone, exact for every input and, on
that strided view, far cheaper than a whole-row minimum (docs/design.md).
Rows are read-only, so a caller who writes into one gets an error instead
of a corrupted cache.
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

import numpy as np

from outlines_maskcache.kernels import BlockedIds, LogitsLost, allowed_from_ids, blocks_few, bound_row, is_sparse
from outlines_maskcache.row_forms import NUMPY_BLOCKED_BELOW


class NumpyKernel:
    name = "numpy"
    #: states blocking at most this fraction of the vocabulary are kept as :class:`BlockedIds`
    #: (the scatter stays cheaper than a strided minimum up to ~30% blocked)
    blocked_below = NUMPY_BLOCKED_BELOW

    def placement(self, logits: np.ndarray, form: str) -> tuple[Hashable, Hashable, str]:
        return "cpu", logits.dtype.str, "bound" if form == "auto" else form

    def row(self, allowed: np.ndarray, form: str, logits: np.ndarray,
            sparse_below: float = 0.0) -> np.ndarray | BlockedIds:
        # As few numpy calls as possible: this runs on every first visit of a
        # state, right after a forward pass evicted the caches (~5-10 us a call).
        count = int(np.count_nonzero(allowed))
        if is_sparse(allowed, sparse_below, count):
            row = _ids(allowed.nonzero()[0])
        elif blocks_few(allowed, self.blocked_below, count):
            ids = _ids(np.logical_not(allowed).nonzero()[0])
            ids.setflags(write=False)
            return BlockedIds(ids, allowed.size)
        elif form == "bound":
            row = bound_row(allowed, logits.dtype)
        else:
            row = ~allowed
        row.setflags(write=False)
        return row

    def nbytes(self, row: np.ndarray | BlockedIds) -> int:
        return int(row.nbytes)

    def valid(self, row: np.ndarray | BlockedIds, form: str, logits: np.ndarray) -> bool:
        if type(row) is BlockedIds:
            ids = row.ids
            return row.width == logits.shape[-1] and isinstance(ids, np.ndarray) and ids.ndim == 1 \
                and ids.dtype == _IDS
        if not isinstance(row, np.ndarray) or row.ndim != 1:
            return False
        if row.dtype == _IDS:
            return row.shape[0] <= logits.shape[-1]
        expected = logits.dtype if form == "bound" else np.dtype(bool)
        return row.dtype == expected and row.shape == (logits.shape[-1],)

    def equal(self, a: np.ndarray | BlockedIds, b: np.ndarray | BlockedIds) -> bool:
        if type(a) is BlockedIds and type(b) is BlockedIds:
            return a.width == b.width and bool(np.array_equal(a.ids, b.ids))
        if type(a) is BlockedIds or type(b) is BlockedIds:
            width = (a if type(a) is BlockedIds else b).width
        elif a.dtype == b.dtype:
            return a.shape == b.shape and bool(np.array_equal(a, b))
        else:
            width = (b if a.dtype == _IDS else a).shape[0]
        return bool(np.array_equal(_allowed(a, width), _allowed(b, width)))

    def apply(self, logits: np.ndarray, rows: Sequence[np.ndarray], form: str, nan_guard: bool,
              scratch: dict[str, Any] | None = None) -> np.ndarray:
        guard = form == "bound" and nan_guard and bool(np.isnan(logits).any())
        for i, row in enumerate(rows):
            view = logits[i]
            if type(row) is BlockedIds:
                view[row.ids] = -np.inf
            elif row.dtype == _IDS:
                # Move the allowed values, never compute with them: exact, NaN included.
                kept = view[row]
                view.fill(-np.inf)
                _put_back(view, row, kept)
            elif form == "bound" and not guard:
                np.minimum(view, row, out=view)
            else:
                view[row == -np.inf if form == "bound" else row] = -np.inf
        return logits


_IDS = np.dtype(np.int64)


def _ids(found: np.ndarray) -> np.ndarray:
    """``nonzero``'s indices as int64 (they already are wherever ``intp`` is 64-bit)."""
    return found if found.dtype == _IDS else found.astype(_IDS)


def _put_back(view: np.ndarray, ids: np.ndarray, kept: np.ndarray) -> None:
    """Restore a sparse row's allowed values; as in the torch kernel, a failed write is
    retried by a second route, and :class:`LogitsLost` stops a fallback onto a damaged row."""
    try:
        view[ids] = kept
    except Exception as err:
        try:
            np.put(view, ids, kept)
        except Exception as again:
            raise LogitsLost(f"could not restore allowed logits after {err!r}") from again
        raise


def _allowed(row: np.ndarray | BlockedIds, width: int) -> np.ndarray:
    """A row of any kind as a bool vector of allowed tokens (for comparing two kinds)."""
    if type(row) is BlockedIds:
        return ~allowed_from_ids(row.ids, width)
    if row.dtype == _IDS:
        return allowed_from_ids(row, width)
    return ~row if row.dtype == bool else row == np.inf


KERNEL = NumpyKernel()
