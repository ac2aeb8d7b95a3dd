"""Which form a mask row is kept and applied in: every threshold of that policy, in one place (no numpy: config reads it).

A state's mask can be kept as a dense row, as the ids of the few tokens it
allows (*sparse*), or as the ids of the few it blocks; an int32 bitmask row
can be applied by the engine's kernel or by a plan.  Which is faster
depends on how many tokens the state allows, and each threshold below was
chosen by a measurement (docs/benchmarks.md).  They decide speed only:
every form gives the same logits.
"""

from __future__ import annotations

#: processors (CPU): a state allowing at most this fraction of the vocabulary
#: is cached as its allowed ids (``configure(sparse_below=...)``'s default)
SPARSE_BELOW = 1 / 64
#: the numpy kernel: a state blocking at most this fraction is kept as its blocked ids
NUMPY_BLOCKED_BELOW = 0.25
#: bitmask plans: a row allowing at most this fraction is planned sparse (past
#: it, copying the allowed logits out and back costs more than the kernel's writes)
PLAN_SPARSE_BELOW = 1 / 4


def plan_kind(allowed: int, n: int) -> str:
    """``sparse`` or ``kernel``: how a bitmask row allowing *allowed* of *n* tokens is applied."""
    return "sparse" if allowed <= PLAN_SPARSE_BELOW * n else "kernel"
