"""Process-wide state: settings, the mask cache, grammar fingerprints, memos, the store and the on/off switch.

One :class:`Runtime` per process owns all of it.  Other modules that keep
per-process state (persisted mask rows, an engine's bitmask plans) hand
their object to :meth:`Runtime.own`, so one ``clear()``, one
``reset_stats()`` and one fork hook reach everything.  Nothing here
survives ``fork`` as shared state: a child gets a copy (CPU rows are plain
memory, CUDA tensors are never valid across processes), and the fork hook
empties the copy's CUDA entries so a child never serves a parent's device
tensor, and re-makes every lock a parent thread may have held.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import logging
import os
import threading
from typing import Any, Iterator, Protocol, TypeVar

from outlines_maskcache.background import Background
from outlines_maskcache.cache import MaskCache
from outlines_maskcache.config import Settings, settings_from_env
from outlines_maskcache.fingerprint import Fingerprint, Memo, Registry
from outlines_maskcache.store import Store, StoreError, default_root

log = logging.getLogger("outlines_maskcache")

P = TypeVar("P")


class Part(Protocol):
    """What an owned object may offer (each method is optional)."""

    def clear(self) -> None: ...

    def after_fork(self) -> None: ...

    def reset_counters(self) -> None: ...

    def at_exit(self) -> None: ...


_disabled: contextvars.ContextVar[int] = contextvars.ContextVar("outlines_maskcache_disabled", default=0)


class Runtime:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.installed = False
        #: per-process state, reached by clear(), reset_stats(), the fork hook and the exit hook
        self._parts: list[Any] = []
        #: parts that report in stats(), by the key they report under
        self._reporting: dict[str, Any] = {}
        self.cache = self.own(MaskCache(settings.max_bytes))
        self.grammars = self.own(Registry(4 * settings.max_grammars, self.cache.drop))
        #: compiled grammars (outlines_core Index, RegexGuide...) by content key
        self.grammar_memo = self.report("grammar_memo", Memo(settings.max_grammars))
        #: token vocabularies converted for a compiler, by tokenizer identity + content
        self.vocabulary_memo = self.report("vocabulary_memo", Memo(max(4, settings.max_grammars // 4)))
        self._logged: set[str] = set()
        self._log_lock = threading.Lock()
        #: (settings it was made for, the store or None); rebuilt when they change
        self._store: tuple[tuple, Store | None] = ((), None)
        #: off the decode path: full compiles behind lazy Indexes, then store writes (both finished at exit)
        self.background = self.own(Background("compiles"))
        self.writes = self.own(Background("store-writes"))
        #: set by the exit hook: engines may refuse new work then (vLLM's compile executor does)
        self.exiting = False

    def own(self, part: P) -> P:
        """Adopt *part* (see :class:`Part`) so that ``clear``, ``reset_stats`` and the fork hook reach it."""
        self._parts.append(part)
        return part

    def settle(self, timeout: float | None = None) -> bool:
        """Wait for the background compiles (and their hand-overs), then the store writes; False on *timeout*."""
        return self.background.drain(timeout) and self.writes.drain(timeout)

    def at_exit(self) -> None:
        """Finish the background work, then let each owned part save what it holds (persisted mask rows)."""
        self.exiting = True
        self.settle()
        self._each("at_exit")

    def report(self, key: str, part: P) -> P:
        """Adopt *part* (as :meth:`own`) and put its ``snapshot()`` in :meth:`stats` under *key*."""
        self._reporting[key] = part
        return self.own(part)

    def _each(self, method: str) -> None:
        for part in self._parts:
            call = getattr(part, method, None)
            if call is not None:
                call()

    def active(self) -> bool:
        return self.installed and not _disabled.get()

    def fingerprint(self, grammar: Any) -> Fingerprint:
        return self.grammars.of(grammar)

    def store(self) -> Store | None:
        """The persistent grammar store for the current settings, or None when it is off."""
        settings = self.settings
        wanted = (settings.store, settings.store_max_bytes)
        made, store = self._store
        if made == wanted:
            return store
        store = None
        if settings.store is not None:
            root = default_root() if settings.store == "auto" else settings.store
            try:
                store = Store(root, settings.store_max_bytes)
            except StoreError as err:  # pragma: no cover - settings are validated first
                log.warning("outlines_maskcache: store off (%s)", err)
        self._store = (wanted, store)
        return store

    def configure(self, **changes: Any) -> Settings:
        settings = self.settings.updated(**changes)
        self.settings = settings
        self.cache.set_max_bytes(settings.max_bytes)
        self.grammar_memo.capacity = settings.max_grammars
        self.vocabulary_memo.capacity = max(4, settings.max_grammars // 4)
        self.grammars.set_capacity(4 * settings.max_grammars)
        return settings

    def clear(self) -> None:
        """Drop every cached mask, memo and owned part's contents (counters and the store's files are kept)."""
        self._each("clear")

    def fault(self, where: str, err: BaseException) -> None:
        """Count a fallback to stock and log it once per place and error type."""
        self.cache.count("fallbacks")
        tag = f"{where}:{type(err).__name__}"
        with self._log_lock:
            if tag in self._logged:
                return
            self._logged.add(tag)
        log.warning("outlines_maskcache: %s failed (%s: %s); used the stock computation", where, type(err).__name__, err)

    def stats(self) -> dict[str, Any]:
        snap = dict(self.cache.snapshot(), installed=self.installed)
        store = self.store()
        snap["store"] = store.snapshot() if store is not None else None
        for key, part in self._reporting.items():
            snap[key] = part.snapshot()
        return snap

    def reset_stats(self) -> None:
        """Start a new observation window: counters to zero, and faults are logged again once."""
        with self._log_lock:
            self._logged.clear()
        store = self._store[1]
        if store is not None:
            store.reset_counters()
        self._each("reset_counters")

    def _after_fork(self) -> None:
        # Locks may have been held by another thread at fork time.
        self._each("after_fork")
        self._log_lock = threading.Lock()
        if self._store[1] is not None:
            self._store[1].after_fork()
        self.cache.drop_devices(lambda device: not str(device).startswith("cpu"))


RUNTIME = Runtime(settings_from_env())
# A script's compiles and store writes finish before it exits: its next run finds them in the store.
atexit.register(RUNTIME.at_exit)

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=RUNTIME._after_fork)


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run stock outlines inside the block, in this thread/task only; nests."""
    token = _disabled.set(_disabled.get() + 1)
    try:
        yield
    finally:
        _disabled.reset(token)
