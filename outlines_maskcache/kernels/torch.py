"""Torch kernel: the ``bound``, ``blocked`` and sparse row forms, and the per-processor slate.

Each form and the measurements that chose it: docs/design.md, "Forms,
chosen by measurement".  ``bound`` (CPU) is ``torch.minimum`` with a
+inf/-inf row, equal to stock's ``masked_fill_`` for every non-NaN logit
(``nan_guard`` repairs a NaN on a blocked token); ``blocked`` (accelerators)
and sparse rows are exact for every input.
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

import numpy as np
import torch

from outlines_maskcache.kernels import LogitsLost, bound_row, is_sparse, write_or_restore

_INF = float("inf")


class TorchKernel:
    name = "torch"

    def placement(self, logits: torch.Tensor, form: str) -> tuple[Hashable, Hashable, str]:
        device = logits.device
        if form == "auto":
            form = "bound" if device.type == "cpu" else "blocked"
        return str(device), logits.dtype, form

    def row(self, allowed: np.ndarray, form: str, logits: torch.Tensor, sparse_below: float = 0.0) -> torch.Tensor:
        if logits.device.type == "cpu" and is_sparse(allowed, sparse_below):
            return torch.from_numpy(np.flatnonzero(allowed))
        if form == "bound":
            if not logits.dtype.is_floating_point:  # ±inf has no integer value: stock's computation runs
                raise TypeError(f"a bound row needs floating logits, not {logits.dtype}")
            # ±inf converts exactly to every floating dtype, bf16 included.
            row = torch.from_numpy(bound_row(allowed)).to(logits.dtype)
        else:
            row = ~torch.from_numpy(allowed)
        return row.to(logits.device, non_blocking=False)

    def nbytes(self, row: torch.Tensor) -> int:
        return row.element_size() * row.numel()

    def valid(self, row: torch.Tensor, form: str, logits: torch.Tensor) -> bool:
        if not isinstance(row, torch.Tensor) or row.dim() != 1 or row.device != logits.device:
            return False
        if row.dtype is _IDS:
            return row.shape[0] <= logits.shape[-1]
        return row.dtype == (logits.dtype if form == "bound" else torch.bool) and row.shape[0] == logits.shape[-1]

    def equal(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        if a.dtype == b.dtype:
            return a.shape == b.shape and bool(torch.equal(a, b))
        # Two kinds of row (ids vs dense, e.g. built under different settings): the same mask?
        width = (b if a.dtype is _IDS else a).shape[0]
        return bool(torch.equal(_allowed(a, width), _allowed(b, width)))

    def apply(self, logits: torch.Tensor, rows: Sequence[torch.Tensor], form: str, nan_guard: bool,
              scratch: dict[str, Any] | None = None) -> torch.Tensor:
        sparse = [i for i, row in enumerate(rows) if row.dtype is _IDS]
        if sparse:
            return _apply_with_sparse(logits, rows, sparse, form, nan_guard)
        first = rows[0]
        same = len(rows) == 1 or all(r is first for r in rows)
        if form == "bound" and nan_guard and bool(torch.isnan(logits).any()):
            blocked = [r == -_INF for r in rows]
            logits.masked_fill_(blocked[0] if same else torch.stack(blocked), -_INF)
            return logits
        if same:
            operand = first
        elif logits.device.type != "cpu":
            operand = torch.stack(list(rows))
        else:
            operand = _slate(scratch, rows, logits.shape) if scratch is not None else None
            if operand is None:
                _apply_rows(list(logits.unbind(0)), rows, form, nan_guard=False)
                return logits
        if form == "blocked":
            logits.masked_fill_(operand, -_INF)
        else:
            torch.minimum(logits, operand, out=logits)
        return logits


_IDS = torch.int64


def _allowed(row: torch.Tensor, width: int) -> torch.Tensor:
    """A dense or sparse row as a bool vector of allowed tokens (for comparing the two kinds)."""
    if row.dtype is _IDS:
        allowed = torch.zeros(width, dtype=torch.bool, device=row.device)
        allowed[row] = True
        return allowed
    return ~row if row.dtype == torch.bool else row == _INF


def _apply_rows(views: Sequence[torch.Tensor], rows: Sequence[torch.Tensor], form: str, nan_guard: bool) -> None:
    """Dense rows applied one per batch row (one C++ loop for the ``bound`` form)."""
    if form == "blocked":
        for view, row in zip(views, rows):
            view.masked_fill_(row, -_INF)
    elif nan_guard and any(bool(torch.isnan(view).any()) for view in views):
        for view, row in zip(views, rows):
            view.masked_fill_(row == -_INF, -_INF)
    else:
        torch._foreach_minimum_(list(views), list(rows))


def _apply_with_sparse(logits: torch.Tensor, rows: Sequence[torch.Tensor], sparse: list[int], form: str,
                       nan_guard: bool) -> torch.Tensor:
    """A batch where some rows are sparse: their allowed values are read, the row set to -inf, and put back.

    Exact for every input, NaN included: allowed values are moved, never
    computed with.  A failed put-back is handled by ``write_or_restore``.
    """
    views = logits.unbind(0)
    kept = [views[i].index_select(0, rows[i]) for i in sparse]
    if len(sparse) < len(rows):
        dense = [i for i in range(len(rows)) if rows[i].dtype is not _IDS]
        _apply_rows([views[i] for i in dense], [rows[i] for i in dense], form, nan_guard)
    def write() -> None:
        if len(sparse) == len(rows):
            logits.fill_(-_INF)
        else:
            for i in sparse:
                views[i].fill_(-_INF)
        for i, values in zip(sparse, kept):
            views[i].index_copy_(0, rows[i], values)

    def restore() -> None:  # a second route: advanced-index assignment
        for i, values in zip(sparse, kept):
            views[i][rows[i]] = values

    write_or_restore(write, restore)
    return logits


def _slate(scratch: dict[str, Any], rows: Sequence[torch.Tensor], shape: torch.Size) -> torch.Tensor | None:
    """The caller's (B, V) buffer holding ``rows``, or None to apply the rows one by one.

    A slate turns a mixed-state batch into one ``minimum`` at the cost of a
    copy for each slate row that is out of date.  That pays while rows keep
    their states (free text in a JSON string), not while most rows move every
    step (a number, a key): then None, and the slate is brought up to date
    on the first step where at most half the rows moved.

    ``scratch["held"][i]`` is the cached row whose copy sits in slate row
    ``i``; holding the object (not its id) keeps its address from being
    reused by another row.  A row is marked unknown before its copy starts,
    so a copy that fails half way is redone next step, never trusted.
    """
    previous = scratch.get("previous", ())
    scratch["previous"] = rows
    moved = len(rows) if len(previous) != len(rows) else sum(r is not p for r, p in zip(rows, previous))
    if 2 * moved > len(rows):
        return None
    dtype = rows[0].dtype
    slate = scratch.get("slate")
    if slate is None or slate.shape != shape or slate.dtype != dtype:
        slate = torch.empty(shape, dtype=dtype, device=rows[0].device)
        scratch.update(slate=slate, views=list(slate.unbind(0)), held=[None] * len(rows))
    views, held = scratch["views"], scratch["held"]
    stale = [i for i, row in enumerate(rows) if row is not held[i]]
    if stale:
        for i in stale:
            held[i] = None
        torch._foreach_copy_([views[i] for i in stale], [rows[i] for i in stale])
        for i in stale:
            held[i] = rows[i]
    return slate


KERNEL = TorchKernel()
