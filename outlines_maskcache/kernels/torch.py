"""Torch kernel.

Forms, chosen by measurement (``outlines-maskcache bench``, docs/design.md):

* ``bound`` (CPU default): a row of +inf (allowed) / -inf (blocked) in the
  logits dtype, applied with ``torch.minimum(logits, row, out=logits)``.
  ``min(x, +inf) == x`` and ``min(x, -inf) == -inf`` for every non-NaN x
  (±0 and ±inf included), so the result equals stock's ``masked_fill_``
  bit for bit; on this CPU it costs the same as one ``add_`` (~17 µs at 128k),
  where ``masked_fill_``/``where`` with a bool row cost 15-30x more.  The one
  input where it differs is a NaN logit on a blocked token (minimum propagates
  NaN, stock writes -inf): ``nan_guard=True`` checks for NaN and repairs.
* ``blocked`` (accelerator default): a bool row of blocked tokens applied with
  ``masked_fill_(-inf)``; exact for every input including NaN, a quarter of
  the bytes, and memory-bound on a GPU.

Rows of a batch that share a state are applied with one broadcast op.  Mixed
states: on accelerators one ``stack`` + one op (O(1) kernel launches); on CPU
one ``_foreach_minimum_`` over the rows (a single C++ loop), measured faster
than gather + op because the gather doubles memory traffic and there is no
launch cost to amortise.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np
import torch

_INF = float("inf")


class TorchKernel:
    name = "torch"

    def placement(self, logits: torch.Tensor, form: str) -> tuple[Hashable, Hashable, str]:
        device = logits.device
        if form == "auto":
            form = "bound" if device.type == "cpu" else "blocked"
        return str(device), logits.dtype, form

    def row(self, allowed: np.ndarray, form: str, logits: torch.Tensor) -> torch.Tensor:
        mask = torch.from_numpy(allowed)
        if form == "bound":
            row = torch.full(mask.shape, -_INF, dtype=logits.dtype)
            row.masked_fill_(mask, _INF)
        else:
            row = ~mask
        return row.to(logits.device, non_blocking=False)

    def nbytes(self, row: torch.Tensor) -> int:
        return row.element_size() * row.numel()

    def valid(self, row: torch.Tensor, form: str, logits: torch.Tensor) -> bool:
        expected = logits.dtype if form == "bound" else torch.bool
        return (
            isinstance(row, torch.Tensor)
            and row.dtype == expected
            and row.device == logits.device
            and row.dim() == 1
            and row.shape[0] == logits.shape[-1]
        )

    def equal(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))

    def apply(self, logits: torch.Tensor, rows: Sequence[torch.Tensor], form: str, nan_guard: bool) -> torch.Tensor:
        first = rows[0]
        same = all(r is first for r in rows)
        if form == "blocked":
            logits.masked_fill_(first if same else torch.stack(list(rows)), -_INF)
            return logits
        if nan_guard and bool(torch.isnan(logits).any()):
            blocked = [r == -_INF for r in rows]
            logits.masked_fill_(blocked[0] if same else torch.stack(blocked), -_INF)
            return logits
        if same:
            torch.minimum(logits, first, out=logits)
        elif logits.device.type == "cpu":
            # One C++ loop over the rows, no gather (see module docstring).
            torch._foreach_minimum_(list(logits.unbind(0)), list(rows))
        else:
            torch.minimum(logits, torch.stack(list(rows)), out=logits)
        return logits


KERNEL = TorchKernel()
