"""The mask cache: a byte-bounded, thread-safe LRU of per-state masks.

It knows nothing about outlines, tensors or grammars.  A key is an opaque
tuple whose first element is the grammar fingerprint and whose second is the
device the value lives on; a value is anything with a byte size.  Budgets are
per device because a GPU row and a CPU row compete for different memory.

Builds run outside the lock: building a mask can take milliseconds (a dense
state at 128k vocabulary) and must not serialise a thread pool.  Two threads
that miss on the same key both build; the second insert finds the first and
keeps it, so the cache never holds two values for one key.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Hashable, Iterable

Key = tuple  # (fingerprint, device, *rest)


@dataclass
class Counters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    #: masks built but not stored because one alone exceeds the budget
    bypasses: int = 0
    #: entries dropped because they failed validation on a hit
    invalid: int = 0
    #: cached path failed and the stock computation ran instead
    fallbacks: int = 0
    #: served masks compared with a fresh build (``verify=True``)
    verified: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class MaskCache:
    def __init__(self, max_bytes: int) -> None:
        self._lock = threading.RLock()
        self._entries: OrderedDict[Key, tuple[Any, int]] = OrderedDict()
        self._bytes: dict[Hashable, int] = {}
        self._max_bytes = max_bytes
        self.counters = Counters()

    # -- configuration -------------------------------------------------
    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    def set_max_bytes(self, max_bytes: int) -> None:
        with self._lock:
            self._max_bytes = max_bytes
            for device in list(self._bytes):
                self._shrink(device, 0)

    # -- lookups -------------------------------------------------------
    def get(self, key: Key) -> Any | None:
        return self.get_many([key])[0]

    def get_many(self, keys: list[Key]) -> list[Any | None]:
        """One lock round-trip for a whole batch's lookups (the warm path).

        Every entry found counts as a hit and becomes most recently used; a
        caller that then finds one unfit to serve hands it to :meth:`reject`.
        """
        found: list[Any | None] = []
        hits = 0
        with self._lock:
            entries = self._entries
            for key in keys:
                entry = entries.get(key)
                if entry is None:
                    found.append(None)
                    continue
                entries.move_to_end(key)
                found.append(entry[0])
                hits += 1
            self.counters.hits += hits
        return found

    def put(self, key: Key, value: Any, size: int) -> Any:
        """Store a freshly built *value* (a miss); return what the cache now serves for *key*.

        That is the value already stored if another thread built it first,
        so all users of one key share one object.
        """
        with self._lock:
            self.counters.misses += 1
            return self._insert(key, value, size)

    def get_or_build(self, key: Key, build: Callable[[], Any], nbytes: Callable[[Any], int]) -> Any:
        """The cached value for *key*, building and storing it on a miss (outside the lock)."""
        value = self.get(key)
        if value is not None:
            return value
        value = build()
        return self.put(key, value, nbytes(value))

    def reject(self, key: Key) -> None:
        """Drop an entry its user found unfit to serve (counted ``invalid``, no longer a hit)."""
        with self._lock:
            self.counters.hits -= 1
            self.counters.invalid += 1
            self._remove(key)

    def _insert(self, key: Key, value: Any, size: int) -> Any:
        existing = self._entries.get(key)
        if existing is not None:
            self._entries.move_to_end(key)
            return existing[0]
        device = key[1]
        if size > self._max_bytes:
            self.counters.bypasses += 1
            return value
        self._shrink(device, size)
        self._entries[key] = (value, size)
        self._bytes[device] = self._bytes.get(device, 0) + size
        return value

    def _shrink(self, device: Hashable, room: int) -> None:
        """Evict least recently used entries of *device* until *room* fits."""
        if self._bytes.get(device, 0) + room <= self._max_bytes:
            return
        for key in [k for k in self._entries if k[1] == device]:
            self._remove(key)
            self.counters.evictions += 1
            if self._bytes.get(device, 0) + room <= self._max_bytes:
                return

    def _remove(self, key: Key) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            device = key[1]
            self._bytes[device] -= entry[1]
            if not self._bytes[device]:
                del self._bytes[device]

    # -- maintenance ---------------------------------------------------
    def drop(self, fingerprints: Iterable[Hashable]) -> None:
        """Forget every entry of the given grammars (they can never be asked for again)."""
        gone = set(fingerprints)
        with self._lock:
            for key in [k for k in self._entries if k[0] in gone]:
                self._remove(key)

    def drop_devices(self, doomed: Callable[[Hashable], bool]) -> None:
        with self._lock:
            for key in [k for k in self._entries if doomed(k[1])]:
                self._remove(key)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes.clear()

    def after_fork(self) -> None:
        self._lock = threading.RLock()

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            if hasattr(self.counters, name) and name != "extra":
                setattr(self.counters, name, getattr(self.counters, name) + n)
            else:
                self.counters.extra[name] = self.counters.extra.get(name, 0) + n

    def reset_counters(self) -> None:
        with self._lock:
            self.counters = Counters()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            c = self.counters
            return {
                **{f.name: getattr(c, f.name) for f in fields(c) if f.name != "extra"},
                **c.extra,
                "entries": len(self._entries),
                "bytes": sum(self._bytes.values()),
                "bytes_by_device": {str(d): b for d, b in self._bytes.items()},
                "max_bytes": self._max_bytes,
            }

    def __len__(self) -> int:
        return len(self._entries)
