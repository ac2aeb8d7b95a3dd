"""Per-framework mask kernels: turn an allowed-token vector into a cached row and apply rows to logits.

Every kernel exposes the same small surface (see :class:`Kernel`) so that
adapters never branch on the tensor library.  Rows are derived from a boolean
"allowed" vector built on the CPU with numpy, which is also the single place
where stock's bitmask layout (bit ``t % 32`` of word ``t // 32``) is decoded.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Protocol, Sequence

import numpy as np


class Kernel(Protocol):
    name: str

    def placement(self, logits: Any, form: str) -> tuple[Hashable, Hashable, str]:
        """(device key, dtype key, concrete form) of the rows that fit *logits*."""

    def row(self, allowed: np.ndarray, form: str, logits: Any, sparse_below: float = 0.0) -> Any:
        """A cached row for *allowed* (bool, length = logits width).

        A kernel may return the allowed ids instead of a dense row when
        :func:`is_sparse` says so: far fewer bytes, and applied by moving the
        few allowed values instead of combining a whole row; or, where
        :func:`blocks_few` says so, the blocked ids (:class:`BlockedIds`).
        """

    def nbytes(self, row: Any) -> int: ...

    def valid(self, row: Any, form: str, logits: Any) -> bool:
        """Cheap metadata check before a cached row is served."""

    def equal(self, a: Any, b: Any) -> bool: ...

    def apply(self, logits: Any, rows: Sequence[Any], form: str, nan_guard: bool,
              scratch: dict[str, Any] | None = None) -> Any:
        """Mask *logits* (B, V) with one row per batch row; return the result.

        *scratch* is a dict the caller keeps for one processor across steps,
        where a kernel may keep buffers (the torch CPU slate); None when the
        rows themselves must be applied (``verify=True``).
        """


class LogitsLost(RuntimeError):
    """A kernel damaged the logits and could not repair them: the step must fail, not fall back."""


class BlockedIds:
    """A row for a state that blocks few tokens: their ids, and the width they were taken from.

    Applied by writing -inf at those ids and nowhere else, which is stock's
    own result for every input (NaN included) and touches a few percent of
    the logits instead of all of them.  A kernel that keeps such rows says
    where they pay (see its ``blocked_below``).
    """

    __slots__ = ("ids", "width")

    def __init__(self, ids: Any, width: int) -> None:
        self.ids = ids
        self.width = width

    @property
    def nbytes(self) -> int:
        return int(self.ids.nbytes)


def blocks_few(allowed: np.ndarray, blocked_below: float, count: int | None = None) -> bool:
    """Whether a state blocks few enough tokens to be kept as :class:`BlockedIds` (*count*: allowed, if known)."""
    if blocked_below <= 0:
        return False
    count = int(np.count_nonzero(allowed)) if count is None else count
    return allowed.size - count <= blocked_below * allowed.size


def is_sparse(allowed: np.ndarray, sparse_below: float, count: int | None = None) -> bool:
    """Whether a state allows few enough tokens to be cached as their ids (*count*: allowed, if known)."""
    if sparse_below <= 0:
        return False
    count = int(np.count_nonzero(allowed)) if count is None else count
    return count <= sparse_below * allowed.size


def bound_row(allowed: np.ndarray, dtype: Any = np.float32) -> np.ndarray:
    """The ``bound`` row of an allowed vector: +inf where allowed, -inf where blocked.

    ``(allowed - 0.5) * inf`` is exactly ±inf for every entry, in one
    vectorised pass: this runs on the first visit of every state.
    """
    if np.dtype(dtype).kind != "f":  # ±inf has no integer value: the adapter falls back to stock
        raise TypeError(f"a bound row needs floating logits, not {np.dtype(dtype)}")
    row = allowed.astype(dtype)
    row -= row.dtype.type(0.5)
    row *= row.dtype.type(np.inf)
    return row


def allowed_from_words(words: np.ndarray, width: int) -> np.ndarray:
    """Decode a stock int32 bitmask into a bool vector of *width* tokens.

    Bits past the bitmask are disallowed, exactly as the stock kernels set
    every logit beyond ``32 * len(words)`` to -inf (``unpackbits`` pads a
    ``count`` past the data with zeros).  One pass, viewed as bool: this runs
    on every first visit of a state, right after a forward pass has evicted
    the caches.
    """
    data = np.ascontiguousarray(words, dtype="<i4").view(np.uint8)
    return np.unpackbits(data, count=width, bitorder="little").view(bool)


def allowed_from_ids(ids: Any, width: int) -> np.ndarray:
    """Bool vector from a list/array of allowed ids; ids outside [0, width) raise like stock indexing would."""
    idx = np.asarray(ids, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < -width or idx.max() >= width):
        raise IndexError(f"allowed token id out of range for logits width {width}")
    allowed = np.zeros(width, dtype=bool)
    allowed[idx] = True
    return allowed


def kernel_for(logits: Any) -> Kernel | None:
    """The kernel for *logits*' library, or None for a library we do not handle."""
    module = type(logits).__module__
    if module.startswith("torch"):
        from outlines_maskcache.kernels.torch import KERNEL
        return KERNEL
    if module.startswith("numpy"):
        from outlines_maskcache.kernels.numpy import KERNEL as NP_KERNEL
        return NP_KERNEL
    if module.startswith("mlx"):
        from outlines_maskcache.kernels.mlx import KERNEL as MLX_KERNEL
        return MLX_KERNEL
    return None


def nbytes_of(row: Any) -> int:
    """Bytes a cached row holds, for a numpy array or a torch tensor."""
    return int(row.nbytes) if hasattr(row, "nbytes") else int(row.numel() * row.element_size())


def write_or_restore(write: Callable[[], None], restore: Callable[[], None]) -> None:
    """Run *write*, which may clobber logits it must keep; on failure *restore* them and re-raise.

    The one moment a row is wrong is between a fill and its put-back.  If
    *write* fails there, *restore* puts every kept value back (which leaves
    only ``-inf`` where the mask blocks, so a stock fallback still sees the
    real logits); if that fails too, :class:`LogitsLost` stops the fallback
    from masking logits whose values are gone.
    """
    try:
        write()
    except Exception as err:
        try:
            restore()
        except Exception as again:
            raise LogitsLost(f"could not restore the logits after {err!r}") from again
        raise
