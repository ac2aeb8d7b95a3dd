"""A never-seen regex's first masks from a lazy Index, with the full Index compiled behind it.

Where :mod:`~outlines_maskcache.lazy_index` can prove its rows equal to the
full Index, the first processor gets a ``LazyIndex`` at once and the full
Index is compiled on the background thread through the usual path (store,
guard).  When it arrives, the rows served so far are checked against it (a
difference switches lazy Indexes off for the process and drops their
masks); it takes the lazy Index's name (same DFA states, so cached masks
stay valid) and its place in the memo, and is handed to the processors
that held the lazy one.  If the full compile fails, the lazy Index goes on
serving.  docs/lazy-index.md.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable, Hashable

import numpy as np

from outlines_maskcache import compiled
from outlines_maskcache import outlines_core_calls as core
from outlines_maskcache.fingerprint import Memo
from outlines_maskcache.lazy_index import LazyGuide, LazyIndex, LazyStats, NotExact, StateTokens, TokenTable
from outlines_maskcache.persisted_masks import PERSISTED
from outlines_maskcache.runtime import RUNTIME
from outlines_maskcache.versions import LAZY_INDEX_PROVEN

log = logging.getLogger("outlines_maskcache")

#: next states checked per state at hand-over (allowed tokens are checked in full)
_NEXT_STATES_CHECKED = 64


class LazyCompiles:
    """Per-process state of lazy compiles: token tables by vocabulary, counters, the off switch a mismatch throws."""

    def __init__(self) -> None:
        self.tables = Memo(4)
        self.rows = LazyStats()
        #: lazy Index -> other cache names whose rows it computed (vLLM's grammar fingerprints)
        self.aliases: weakref.WeakKeyDictionary[LazyIndex, set[str]] = weakref.WeakKeyDictionary()
        self.lock = threading.Lock()
        self.broken: str | None = None
        self.reset_counters()

    def count(self, name: str) -> None:
        with self.lock:
            self.counters[name] += 1

    def snapshot(self) -> dict[str, Any]:
        on, why = enabled()
        return {"on": on, "why": why, **self.counters, "states_built": self.rows.states_built,
                "state_seconds": round(self.rows.seconds, 6)}

    def reset_counters(self) -> None:
        self.counters = dict.fromkeys(("served", "refused", "handed_over", "full_failed", "faults"), 0)
        self.rows.states_built, self.rows.seconds = 0, 0.0

    def clear(self) -> None:
        """Forget token tables, and a mismatch's off switch (``mc.clear()`` starts over)."""
        self.tables.clear()
        self.broken = None

    def after_fork(self) -> None:
        self.tables.after_fork()
        self.aliases = weakref.WeakKeyDictionary(self.aliases)
        self.lock = threading.Lock()
        self.rows.lock = threading.Lock()


LAZY = RUNTIME.report("lazy_index", LazyCompiles())


def enabled() -> tuple[bool, str]:
    """(whether never-seen regexes are served lazily, why)."""
    setting = RUNTIME.settings.lazy_index
    if LAZY.broken:
        return False, f"off: {LAZY.broken}"
    if setting is False:
        return False, "off (configure(lazy_index=False) or OUTLINES_MASKCACHE_LAZY_INDEX=0)"
    version = core.version()
    if version not in LAZY_INDEX_PROVEN:
        if setting is None:
            return False, (f"off: CI proves the lazy Index for outlines_core {', '.join(LAZY_INDEX_PROVEN)}, "
                           f"not {version} (configure(lazy_index=True) to use it anyway)")
        return True, f"on (forced: outlines_core {version} is not proven in CI)"
    return True, f"on (outlines_core {version} is proven in CI)"


def _table(vocabulary: Any) -> TokenTable:
    """The vocabulary's token table: memoized, and in the store beside the vocabulary when that is named by content."""
    name = RUNTIME.fingerprint(vocabulary)

    def build() -> TokenTable:
        def make() -> TokenTable:
            return TokenTable.of(*core.vocabulary_tokens(vocabulary))

        if not core.is_vocabulary_key(name):
            table = make()
        else:
            table = compiled.stored("token-table", (name,), make, TokenTable.from_bytes, TokenTable.to_bytes)
        table.by_prefix()  # its orders (~10 ms at 128k tokens) belong to the background build, not a first mask
        table.first_ids()
        import numpy.ma  # noqa: F401 - np.unique imports it on first use (~10 ms): here too, not before a first mask
        return table

    return LAZY.tables.get_or_build(name, build)


def prepare(vocabulary: Any) -> None:
    """Build *vocabulary*'s token table on the background thread (about a second at 128k tokens), ahead of its first schema."""
    if enabled()[0]:
        RUNTIME.background.submit("token table", lambda: _table(vocabulary))


def index_for(regex: str, vocabulary: Any, vocab_key: str | None, memo_key: Hashable,
              compile_full: Callable[[], Any]) -> Any:
    """The Index a regex's first processor gets: the stored one, a lazy one with the full compile behind it, or the full one."""
    on, _ = enabled()
    if not on:
        return compile_full()
    if vocab_key is not None:
        stored = compiled.from_store("index", (vocab_key, regex), core.load_index)
        if stored is not None:
            return stored
    try:
        lazy = core.lazy_index(regex, vocabulary, _table(vocabulary), stats=LAZY.rows, compile=_compiler())
    except NotExact as refused:
        LAZY.count("refused")
        log.debug("outlines_maskcache: full compile for this regex (%s)", refused)
        return compile_full()
    except Exception as err:  # noqa: BLE001 - whatever goes wrong here, stock's compile decides
        LAZY.count("faults")
        RUNTIME.fault("lazy index", err)
        return compile_full()
    LAZY.count("served")
    RUNTIME.background.submit("full compile behind a lazy Index", lambda: _hand_over(lazy, memo_key, compile_full))
    return lazy


def _compiler() -> Callable[[str, Any, str], Any] | None:
    """With the compile guard on, the byte-level and probe Indexes are built in its worker, under its limits."""
    if not compiled.guarded():
        return None
    from outlines_maskcache.guard import compile_index as in_worker

    settings = RUNTIME.settings
    return lambda regex, vocabulary, name: in_worker(regex, vocabulary, name, settings.compile_timeout,
                                                     settings.compile_max_bytes)


def follow(processor: Any, index: Any) -> None:
    """Have *processor* handed the full Index when *index* (if lazy) gets one."""
    if isinstance(index, LazyIndex):
        index.followers.add(processor)


def rows_named(index: Any, name: str) -> None:
    """Rows cached under *name* come from *index*: if it is lazy and its hand-over finds a difference, they go with it.

    For engines that key rows by their own grammar's name rather than the
    Index's (vLLM).
    """
    if isinstance(index, LazyIndex):
        with LAZY.lock:
            LAZY.aliases.setdefault(index, set()).add(name)


def _hand_over(lazy: LazyIndex, memo_key: Hashable, compile_full: Callable[[], Any]) -> None:
    try:
        full = compile_full()
    except Exception as err:  # noqa: BLE001 - the lazy Index keeps serving exact masks
        LAZY.count("full_failed")
        # At exit an engine may refuse the compile (vLLM's executor is shut down): nothing is lost but the store entry.
        log.log(logging.DEBUG if RUNTIME.exiting else logging.WARNING,
                "outlines_maskcache: the full compile behind a lazy Index failed (%s: %s); the lazy Index "
                "goes on serving", type(err).__name__, err)
        return
    difference = _first_difference(lazy, full)
    name = RUNTIME.fingerprint(lazy)
    if difference is not None:
        LAZY.broken = f"a lazy row differed from the full Index ({difference})"
        log.error("outlines_maskcache: %s; lazy Indexes are off for this process", LAZY.broken)
        with LAZY.lock:
            names = {name, *LAZY.aliases.pop(lazy, ())}
        lazy.adopt(lambda state: _full_row(full, state), full.get_final_states())
        RUNTIME.cache.drop(names)
        for served in names:
            PERSISTED.forget_grammar(served)
    else:
        RUNTIME.grammars.register(full, name)
    RUNTIME.grammar_memo.replace(memo_key, lazy, full)
    for processor in list(lazy.followers):
        if getattr(processor, "index", None) is lazy:
            processor.index = full
            LAZY.count("handed_over")


def _full_row(full: Any, state: int) -> StateTokens | None:
    found = core.index_row(full, state)
    return None if found is None else StateTokens(*found)


def _first_difference(lazy: LazyIndex, full: Any) -> str | None:
    """The first state whose served row is not the full Index's, or None."""
    if full.get_initial_state() != lazy.initial_state:
        return "initial state"
    for state, row in lazy.computed_rows().items():
        expected = full.get_allowed_tokens(state)
        if expected is None or not np.array_equal(np.sort(np.asarray(expected, dtype=np.int64)), row.token_ids):
            return f"state {state}: allowed tokens"
        if full.is_final_state(state) != lazy.is_final_state(state):
            return f"state {state}: finality"
        step = max(1, len(row.token_ids) // _NEXT_STATES_CHECKED)
        for token, next_state in zip(row.token_ids[::step].tolist(), row.next_states[::step].tolist()):
            if token != lazy.eos_token_id and full.get_next_state(state, token) != next_state:
                return f"state {state}, token {token}: next state"
    return None


def guide_factory(stock_guide: Any) -> Callable[..., Any]:
    """outlines' ``Guide`` name, taking a lazy Index too: stock's processors then run unchanged on one."""

    def Guide(index: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - it stands in for a class
        if isinstance(index, LazyIndex):
            return LazyGuide(index, *args, **kwargs)
        return stock_guide(index, *args, **kwargs)

    Guide.__doc__ = stock_guide.__doc__
    return Guide


def settle(timeout: float | None = None) -> bool:
    """Wait for the background work (full compiles and their hand-overs, store writes); False on *timeout*."""
    return RUNTIME.settle(timeout)


def store_token_table(vocabulary: Any) -> None:
    """Build (or load) *vocabulary*'s token table now, so that it is in the store: the deploy step's part of the lazy Index."""
    if core.is_vocabulary_key(RUNTIME.fingerprint(vocabulary)):
        _table(vocabulary)
