"""vLLM applies: every step's bitmask, its CPU rows planned (:mod:`outlines_maskcache.kernels.bitmask_plans`).

vLLM applies the bitmask with xgrammar's ``apply_token_bitmask_inplace``,
reached through ``vllm.v1.structured_output.utils.xgr``.  That global is
replaced by :class:`XgrammarStandIn`, whose ``apply_token_bitmask_inplace``
hands CPU rows that allow few tokens to the
:class:`~outlines_maskcache.kernels.bitmask_plans.BitmaskApplier`
(keep-fill-restore) and every other row, and every GPU tensor, to
xgrammar, with the kernel's exact semantics.  The fill tells it which
sparse cached rows it served (a hint, verified word for word against the
bitmask).  ``configure(plan_sparse_rows=False)`` (or
``OUTLINES_MASKCACHE_SPARSE_APPLY=0``) leaves every row to xgrammar.

Releases that do not apply through ``utils.apply_grammar_bitmask`` (vLLM
0.34 moved the CPU apply into its CPU worker) get no stand-in and keep
stock's apply; the install log says so (docs/engines.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from outlines_maskcache import stats_file
from outlines_maskcache.gate import cached_or_stock
from outlines_maskcache.kernels.bitmask_plans import BitmaskApplier
from outlines_maskcache.runtime import RUNTIME

#: plans for the bitmask rows this process applies (one engine per process)
APPLIER = RUNTIME.own(BitmaskApplier())


class XgrammarStandIn:
    """The ``xgrammar`` module as vLLM's ``apply_grammar_bitmask`` sees it: sparse CPU rows planned.

    Everything but ``apply_token_bitmask_inplace`` is the module's own.  vLLM
    holds xgrammar behind a ``LazyLoader`` that, on first use, overwrites the
    global it sits in with the real module, which would silently drop this
    stand-in; so the module is imported here by name instead, and the loader
    object is what ``uninstall`` puts back.
    """

    def __init__(self, original: Any) -> None:
        self.original = original
        self._name = getattr(original, "__name__", "xgrammar")
        self._module: Any = None

    @property
    def _inner(self) -> Any:
        module = self._module
        if module is None:
            import importlib

            module = self._module = importlib.import_module(self._name)
        return module

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    def apply_token_bitmask_inplace(self, logits: Any, bitmask: Any, *args: Any, **kwargs: Any) -> None:
        stock = self._inner.apply_token_bitmask_inplace
        # vocab_size goes to xgrammar: its CPU kernel masks whole words past
        # one that is not a multiple of 32, unlike its documentation (vLLM passes none).
        settings = RUNTIME.settings
        if args or not kwargs.keys() <= {"indices"} or not RUNTIME.active():
            return stock(logits, bitmask, *args, **kwargs)
        by_content, served = FILLED_ROWS.take()
        if (not (by_content or served) or not settings.plan_sparse_rows
                or not APPLIER.applies_to(logits, bitmask)):
            return stock(logits, bitmask, *args, **kwargs)
        indices = kwargs.get("indices")
        rows = indices.tolist() if hasattr(indices, "tolist") else indices

        def rest(found: list[int] | None) -> None:
            if found is None:
                stock(logits, bitmask, **kwargs)
            elif found:
                stock(logits, bitmask, indices=found)

        counts = cached_or_stock("vllm-v1 bitmask apply",
                                 lambda: APPLIER.apply(logits, bitmask, rows, None, rest, expected=served,
                                                       by_content=by_content),
                                 lambda: stock(logits, bitmask, *args, **kwargs))
        if counts is None:  # the stock kernel ran
            return None
        RUNTIME.cache.count("sparse_apply_rows", counts.sparse)
        RUNTIME.cache.count("kernel_apply_rows", counts.kernel)
        stats_file.filled()  # a worker apart from the EngineCore reports too


class FilledRows:
    """The sparse cached rows the fill served since the last apply: the apply's hint.

    Matched to the bitmask word for word, so a stale hint costs time, never
    correctness; a step without a sparse row passes nothing.  A process that
    applies bitmasks it never filled has no hint and finds sparse rows by
    content.
    """

    def __init__(self) -> None:
        self.seen_fills = False
        #: id -> served row, since the last apply (the references keep the ids unique)
        self._served: dict[int, np.ndarray] = {}
        #: id of a served cached row -> whether it is worth planning (rows live in the cache)
        self._known: dict[int, bool] = {}

    def filled(self, row: np.ndarray) -> None:
        self.seen_fills = True
        key = id(row)
        plannable = self._known.get(key)
        if plannable is None:
            if len(self._known) >= 65_536:
                self._known.clear()
            plannable = self._known[key] = APPLIER.would_plan(row)
        if plannable:
            if len(self._served) >= 4_096:  # fills with no apply here (a worker applies): keep no history
                self._served.clear()
            self._served[key] = row

    def clear(self) -> None:
        self.__init__()  # type: ignore[misc]

    after_fork = clear  # a forked worker has filled nothing yet

    def take(self) -> tuple[bool, list[np.ndarray]]:
        """(look for sparse rows by content, the served rows to match) for this apply."""
        served, self._served = self._served, {}
        return not self.seen_fills, list(served.values())


FILLED_ROWS = RUNTIME.own(FilledRows())
