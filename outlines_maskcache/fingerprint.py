"""Grammar fingerprints and the bounded memo of compiled grammars.

A cached mask is only as correct as its key, whose first element names the
compiled grammar the mask was read from, in one of two ways:

* **content**: a digest of the vocabulary's name and the regex, for
  grammars built through :class:`Memo`; it survives across calls, so the
  second ``model(prompt, User)`` hits what the first cached.
* **identity**: a fresh token for an object someone else built, holding a
  strong reference while the token lives so its ``id`` is never recycled
  under our feet; when the registry forgets it, its masks are dropped.

The memo exists because outlines 1.x rebuilds the Vocabulary and Index on
every call; an Index is deterministic in (regex, vocabulary), so reusing
one changes no result.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections import OrderedDict
from typing import Any, Callable, Hashable

Fingerprint = str
#: fingerprints that name a grammar only inside this process: identity
#: tokens, and names built from per-process hashes; nothing keyed by one
#: may be persisted
IDENTITY_PREFIX = "id:"
LOCAL_PREFIX = "local:"


def is_content(fingerprint: object) -> bool:
    """True for a fingerprint that names the same grammar in every process."""
    return isinstance(fingerprint, str) and not fingerprint.startswith((IDENTITY_PREFIX, LOCAL_PREFIX))


def digest(*parts: object, length: int = 32) -> Fingerprint:
    """*length* hex digits of sha256 over the parts, each length-prefixed (bytes as they are, anything else its repr)."""
    h = hashlib.sha256()
    for part in parts:
        data = part if isinstance(part, bytes) else repr(part).encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:length]


def vocabulary_hash(vocab: dict) -> Any:
    """A cheap content key for a token->id(s) dict (a memo key, not a fingerprint).

    ``hash(frozenset(items))`` costs ~10 ms at 128k tokens, against the
    0.3-1.2 s build it guards; unhashable values fall back to the digest.
    """
    try:
        return hash(frozenset(vocab.items()))
    except TypeError:  # lists of ids: an order-independent digest
        return digest("\x00".join(sorted(repr(item) for item in vocab.items())))


class Registry:
    """Fingerprints of live grammar objects, bounded, with eviction callbacks."""

    def __init__(self, capacity: int, on_forget: Callable[[list[Fingerprint]], None]) -> None:
        self._lock = threading.Lock()
        self._by_id: OrderedDict[int, tuple[Any, Fingerprint]] = OrderedDict()
        self._capacity = capacity
        self._on_forget = on_forget
        self._tokens = itertools.count()
        #: bumped whenever a grammar is forgotten, so a holder of a fingerprint
        #: (a processor's Masker) knows when to ask :meth:`of` again instead
        #: of asking (and taking this lock) on every decoding step
        self.generation = 0

    def set_capacity(self, capacity: int) -> None:
        with self._lock:
            self._capacity = capacity
            forgotten = self._trim()
        self._forget(forgotten)

    def register(self, obj: Any, fingerprint: Fingerprint) -> None:
        with self._lock:
            self._by_id[id(obj)] = (obj, fingerprint)
            self._by_id.move_to_end(id(obj))
            forgotten = self._trim()
        self._forget(forgotten)

    def get(self, obj: Any) -> Fingerprint | None:
        """The fingerprint *obj* is registered under, without registering it."""
        with self._lock:
            entry = self._by_id.get(id(obj))
            return entry[1] if entry is not None and entry[0] is obj else None

    def of(self, obj: Any) -> Fingerprint:
        with self._lock:
            entry = self._by_id.get(id(obj))
            if entry is not None and entry[0] is obj:
                self._by_id.move_to_end(id(obj))
                return entry[1]
            fingerprint = f"{IDENTITY_PREFIX}{next(self._tokens)}"
            self._by_id[id(obj)] = (obj, fingerprint)
            forgotten = self._trim()
        self._forget(forgotten)
        return fingerprint

    def _trim(self) -> list[Fingerprint]:
        forgotten = []
        while len(self._by_id) > self._capacity:
            _, (_, fingerprint) = self._by_id.popitem(last=False)
            forgotten.append(fingerprint)
        if forgotten:
            self.generation += 1
        return forgotten

    def _forget(self, fingerprints: list[Fingerprint]) -> None:
        # Content fingerprints may come back (the same schema compiled again),
        # but their masks are still right then; only identity tokens are dead.
        dead = [fp for fp in fingerprints if fp.startswith(IDENTITY_PREFIX)]
        if dead:
            self._on_forget(dead)

    def after_fork(self) -> None:
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            forgotten = [fp for _, fp in self._by_id.values()]
            self._by_id.clear()
            self.generation += 1
        self._forget(forgotten)


class Memo:
    """A small thread-safe LRU of expensive, deterministic builds."""

    def __init__(self, capacity: int) -> None:
        self._lock = threading.Lock()
        self._items: OrderedDict[Hashable, Any] = OrderedDict()
        self._building: dict[Hashable, threading.Lock] = {}
        self.capacity = capacity
        self.hits = 0
        self.misses = 0

    def get_or_build(self, key: Hashable, build: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                self.hits += 1
                return self._items[key]
            gate = self._building.setdefault(key, threading.Lock())
        # One build per key at a time: a server that receives the same schema
        # from 32 threads at once compiles it once, not 32 times.
        with gate:
            with self._lock:
                if key in self._items:
                    self.hits += 1
                    return self._items[key]
            try:
                value = build()
            except BaseException:
                with self._lock:
                    self._building.pop(key, None)
                raise
            with self._lock:
                self.misses += 1
                self._items[key] = value
                while len(self._items) > self.capacity:
                    self._items.popitem(last=False)
                self._building.pop(key, None)
            return value

    def replace(self, key: Hashable, old: Any, new: Any) -> bool:
        """Put *new* under *key* where *old* still is (a lazy Index handing over to the full one)."""
        with self._lock:
            if self._items.get(key) is not old:
                return False
            self._items[key] = new
            return True

    def snapshot(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "entries": len(self._items)}

    def reset_counters(self) -> None:
        self.hits = self.misses = 0

    def after_fork(self) -> None:
        self._lock = threading.Lock()
        self._building = {}

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __len__(self) -> int:
        return len(self._items)
