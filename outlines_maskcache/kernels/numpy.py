"""Numpy kernel (llama.cpp, and outlines' numpy tensor adapter).

Same ``bound`` form as the torch CPU kernel, applied with ``np.minimum`` into
the caller's array, so llama.cpp's strided float32 view of its candidate
array is written in place.  ``blocked`` (a bool row, boolean-index
assignment of -inf) is exact for NaN too.  Rows are made read-only so that a
caller who writes into one gets an error instead of a corrupted cache.
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

import numpy as np


class NumpyKernel:
    name = "numpy"

    def placement(self, logits: np.ndarray, form: str) -> tuple[Hashable, Hashable, str]:
        return "cpu", logits.dtype.str, "bound" if form == "auto" else form

    def row(self, allowed: np.ndarray, form: str, logits: np.ndarray) -> np.ndarray:
        if form == "bound":
            row = np.full(allowed.shape, -np.inf, dtype=logits.dtype)
            row[allowed] = np.inf
        else:
            row = ~allowed
        row.setflags(write=False)
        return row

    def nbytes(self, row: np.ndarray) -> int:
        return int(row.nbytes)

    def valid(self, row: np.ndarray, form: str, logits: np.ndarray) -> bool:
        expected = logits.dtype if form == "bound" else np.dtype(bool)
        return isinstance(row, np.ndarray) and row.dtype == expected and row.shape == (logits.shape[-1],)

    def equal(self, a: np.ndarray, b: np.ndarray) -> bool:
        return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))

    def apply(self, logits: np.ndarray, rows: Sequence[np.ndarray], form: str, nan_guard: bool,
              scratch: dict[str, Any] | None = None) -> np.ndarray:
        if form == "bound" and nan_guard and bool(np.isnan(logits).any()):
            rows, form = [r == -np.inf for r in rows], "blocked"
        for i, row in enumerate(rows):
            view = logits[i]
            if form == "bound":
                np.minimum(view, row, out=view)
            else:
                view[row] = -np.inf
        return logits


KERNEL = NumpyKernel()
