"""MLX kernel (mlx-lm).

Stock outlines builds a new array per row with a Metal kernel and
concatenates; MLX arrays are immutable, so we return one ``mx.where`` over
the batch with stacked cached rows (exact for every input, NaN included).
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

import numpy as np


class MLXKernel:
    name = "mlx"

    def placement(self, logits: Any, form: str) -> tuple[Hashable, Hashable, str]:
        return "mlx", str(logits.dtype), "allowed"

    def row(self, allowed: np.ndarray, form: str, logits: Any, sparse_below: float = 0.0) -> Any:
        # One mx.where over the batch is exact and cheap; MLX keeps dense bool rows.
        import mlx.core as mx
        return mx.array(allowed)

    def nbytes(self, row: Any) -> int:
        return int(row.nbytes)

    def valid(self, row: Any, form: str, logits: Any) -> bool:
        return tuple(row.shape) == (logits.shape[-1],)

    def equal(self, a: Any, b: Any) -> bool:
        import mlx.core as mx
        return bool(mx.array_equal(a, b))

    def apply(self, logits: Any, rows: Sequence[Any], form: str, nan_guard: bool,
              scratch: dict[str, Any] | None = None) -> Any:
        import mlx.core as mx
        allowed = rows[0][None, :] if all(r is rows[0] for r in rows) else mx.stack(list(rows))
        return mx.where(allowed, logits, mx.array(-np.inf, dtype=logits.dtype))


KERNEL = MLXKernel()
