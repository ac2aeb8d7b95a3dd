"""Bitmask rows persisted beside their grammar, so a restarted process starts warm.

A state's mask is a pure function of the compiled grammar and the state,
so once any process has asked outlines_core for it, no process needs to
ask again.  Each grammar named by its *content* (an identity token means
nothing in another process) gets one store entry of the rows of the
states visited so far: loaded on first use, saved back merged with what
other processes added, mid-run on the runtime's store-write thread (a save
re-reads, merges and hashes up to 64 MiB) and at exit.

Payload (little-endian), verified again after the store's checksum:
``b"OMCMASKS"``, u32 words per row, u32 reserved, u64 row count, the states
(u64 each), the rows (int32).  Rows are served as read-only views of the
verified bytes.
"""

from __future__ import annotations

import os
import struct
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from outlines_maskcache import outlines_core_calls as core
from outlines_maskcache.compiled import store_key
from outlines_maskcache.fingerprint import is_content
from outlines_maskcache.runtime import RUNTIME

_MAGIC = b"OMCMASKS"
_HEAD = struct.Struct("<8sIIQ")
#: grammars whose rows a process keeps in this layer at once
_MAX_GRAMMARS = 64
#: bytes of rows persisted per grammar: a grammar visited in tens of
#: thousands of states would otherwise write hundreds of MB (16 KiB a row at
#: 128k tokens); rows past the cap are cached in memory only
MAX_GRAMMAR_BYTES = 64 << 20
#: save once this many rows are new and they are at least this share of the known ones
_SAVE_AFTER = 64
_SAVE_SHARE = 0.25


class GrammarRows:
    """The persisted and newly learned rows of one grammar at one row width."""

    __slots__ = ("fingerprint", "n_words", "rows", "new", "lock")

    def __init__(self, fingerprint: str, n_words: int) -> None:
        self.fingerprint = fingerprint
        self.n_words = n_words
        self.rows: dict[int, np.ndarray] = {}
        self.new = 0
        self.lock = threading.Lock()

    def key(self) -> str:
        return store_key("masks", self.fingerprint, self.n_words)


def encode(n_words: int, rows: dict[int, np.ndarray]) -> bytes:
    states = np.fromiter(rows.keys(), dtype="<u8", count=len(rows))
    body = np.stack([rows[int(s)] for s in states]).astype("<i4", copy=False) if rows else np.empty((0, n_words), "<i4")
    return _HEAD.pack(_MAGIC, n_words, 0, len(rows)) + states.tobytes() + body.tobytes()


def decode(data: bytes, n_words: int) -> dict[int, np.ndarray]:
    """Rows from a payload; ValueError for anything not exactly this format at this width."""
    if len(data) < _HEAD.size:
        raise ValueError("mask entry shorter than its header")
    magic, width, _, count = _HEAD.unpack_from(data)
    if magic != _MAGIC or width != n_words:
        raise ValueError("not a mask entry of this row width")
    if len(data) != _HEAD.size + count * 8 + count * n_words * 4:
        raise ValueError("mask entry length does not match its row count")
    states = np.frombuffer(data, dtype="<u8", count=count, offset=_HEAD.size)
    body = np.frombuffer(data, dtype="<i4", offset=_HEAD.size + count * 8).reshape(count, n_words)
    return {int(s): body[i] for i, s in enumerate(states)}


class PersistedMasks:
    """Per-process view of the persisted rows of recently used grammars."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._grammars: OrderedDict[tuple[str, int], GrammarRows] = OrderedDict()
        #: grammars with a save queued, once each (keyed by identity)
        self._due: dict[int, GrammarRows] = {}

    def grammar(self, fingerprint: Any, n_words: int) -> GrammarRows | None:
        """The rows of a content-named grammar (loaded on first use); None when nothing can be persisted."""
        if not is_content(fingerprint):
            return None
        store = RUNTIME.store()
        if store is None:
            return None
        slot = (fingerprint, n_words)
        found = self._grammars.get(slot)  # the per-token path: no lock (a dict read is atomic)
        if found is not None:
            try:
                self._grammars.move_to_end(slot)
            except KeyError:  # evicted by another thread just now: still valid to serve
                pass
            return found
        found = GrammarRows(fingerprint, n_words)
        key = found.key()
        data = store.get(key)
        if data is not None:
            try:
                found.rows = decode(data, n_words)
            except ValueError as err:
                store.discard(key, f"mask rows do not decode ({err})")
        with self._lock:
            found = self._grammars.setdefault(slot, found)
            while len(self._grammars) > _MAX_GRAMMARS:
                _, gone = self._grammars.popitem(last=False)
                self._schedule(gone)
        return found

    def learned(self, rows: GrammarRows, state: int, row: np.ndarray) -> None:
        with rows.lock:
            if state in rows.rows or (len(rows.rows) + 1) * row.nbytes > MAX_GRAMMAR_BYTES:
                return
            rows.rows[state] = row
            rows.new += 1
            due = rows.new >= _SAVE_AFTER and rows.new >= _SAVE_SHARE * len(rows.rows)
        if due:
            with self._lock:
                self._schedule(rows)

    def _schedule(self, rows: GrammarRows) -> None:
        """Queue one save of *rows* on the runtime's store-write thread.  Caller holds ``_lock``."""
        if id(rows) not in self._due:
            self._due[id(rows)] = rows
            RUNTIME.writes.submit("mask rows save", lambda: self._save_queued(rows))

    def _save_queued(self, rows: GrammarRows) -> None:
        with self._lock:
            if self._due.pop(id(rows), None) is None:
                return  # dropped by clear() or saved by save_all() meanwhile
        self._save(rows)

    def forget(self, rows: GrammarRows, why: str = "a persisted mask row differs from a fresh build") -> None:
        """Drop a grammar whose persisted rows failed verification (here and in the store)."""
        store = RUNTIME.store()
        with self._lock:
            self._grammars.pop((rows.fingerprint, rows.n_words), None)
        if store is not None:
            store.discard(rows.key(), why)

    def forget_grammar(self, fingerprint: Any) -> None:
        """Drop every row width of a grammar whose rows can no longer be trusted (here and in the store)."""
        with self._lock:
            doomed = [rows for slot, rows in self._grammars.items() if slot[0] == fingerprint]
            for rows in doomed:
                self._due.pop(id(rows), None)
        for rows in doomed:
            self.forget(rows, "its rows came from a lazy Index that differed from the full one")

    def _save(self, rows: GrammarRows) -> None:
        store = RUNTIME.store()
        with rows.lock:
            if not rows.new or store is None:
                return
            merged = dict(rows.rows)
            rows.new = 0
        key = rows.key()
        data = store.get(key)  # rows other processes saved meanwhile are kept
        if data is not None:
            try:
                for state, row in decode(data, rows.n_words).items():
                    merged.setdefault(state, row)
            except ValueError:
                pass  # replaced whole below
        store.put(key, encode(rows.n_words, merged))
        RUNTIME.cache.count("mask_rows_saved", len(merged))

    def save_all(self) -> None:
        """Save every grammar with new rows now (at exit, and for tests), after the saves already queued."""
        RUNTIME.writes.drain()
        with self._lock:
            grammars = list(self._grammars.values())
            grammars += [r for r in self._due.values() if all(r is not g for g in grammars)]
            self._due.clear()
        for rows in grammars:
            try:
                self._save(rows)
            except Exception:  # noqa: BLE001 - at exit, a failed save is only a colder restart
                pass

    def clear(self) -> None:
        """Forget every grammar; queued saves are dropped, one in flight finishes first."""
        with self._lock:
            self._grammars.clear()
            self._due.clear()
        RUNTIME.writes.drain()

    at_exit = save_all

    def after_fork(self) -> None:
        # The parent's queued saves did not survive the fork; the child saves its grammars at its exit.
        self._lock = threading.Lock()
        self._due = {}
        for rows in self._grammars.values():
            rows.lock = threading.Lock()


PERSISTED = RUNTIME.own(PersistedMasks())


def words_of(fingerprint: Any, guide: Any, n_words: int, state: int | None = None) -> np.ndarray:
    """The int32 bitmask words of *guide*'s state: persisted, else stock's ``write_mask_into`` (then persisted).

    *state* is ``guide.get_state()`` when the caller already read it.
    Returned arrays are read-only.
    """
    rows = PERSISTED.grammar(fingerprint, n_words)
    if state is None:
        state = guide.get_state()
    if rows is not None:
        found = rows.rows.get(state)
        if found is not None:
            RUNTIME.cache.count("persisted_rows")
            if RUNTIME.settings.verify:
                fresh = write_words(guide, n_words)
                if not np.array_equal(found, fresh):
                    PERSISTED.forget(rows)
                    raise AssertionError(f"persisted mask row for state {state} differs from a fresh build")
            return found
    row = write_words(guide, n_words)
    if rows is not None:
        PERSISTED.learned(rows, state, row)
    return row


def write_words(guide: Any, n_words: int) -> np.ndarray:
    """Stock's own bitmask write for the guide's state, counted."""
    row = core.write_words(guide, n_words)
    RUNTIME.cache.count("mask_writes")
    return row
