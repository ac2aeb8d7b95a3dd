"""A directory of verified, content-addressed blobs that processes and machines share.

It knows nothing about outlines: callers hand it a key (a hex digest of
everything the blob depends on) and bytes; it hands back the same bytes or
nothing.  Entries are never invalidated, only evicted, because a key that
names all its inputs can never go stale.

Why files with atomic renames and not diskcache (SQLite): the store must
work on a shared filesystem (a volume baked into an image, NFS between
replicas), where SQLite's locking is unreliable, and it must never unpickle
what it reads (diskcache pickles values by default).  A file per entry needs
no lock at all: a writer writes a private temporary file and ``os.replace``s
it into place, so a reader sees the old entry, the new one or none, never a
torn one.  Two writers of one key write equal bytes; the last rename wins.

Safety model: everything read back is untrusted until verified.  An entry is
a fixed header (magic, format, payload length, sha256 of the key, the
payload's digest) then the payload; a read that fails any check is a miss, the
entry is deleted, counted as ``corrupt`` and logged once.  Nothing from the
directory is ever passed to ``pickle``: callers load verified bytes with a
schema-checked decoder (outlines_core's ``from_binary``).

A read-only, missing or full directory degrades with one warning: reads go
on where they can (a store baked into a read-only image still serves), writes
stop for the process.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import struct
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

log = logging.getLogger("outlines_maskcache")

MAGIC = b"OMCSTORE"
#: 2: the payload digest became a hash tree over chunks (format 1: one sha256)
FORMAT = 2
#: magic, format, payload length, sha256(key), the payload's digest (see ``_digest``)
_HEADER = struct.Struct("<8sHQ32s32s")
#: the payload's digest is sha256 over the sha256 of each slice of this many
#: bytes, so that one large entry is read and verified by several threads at
#: once (``os.preadv`` and hashlib release the GIL); a 67 MB Index took 71 ms
#: to read and hash in one thread, 37 ms in two
_CHUNK = 4 << 20
_MAX_READERS = 8
_KEY = re.compile(r"^[0-9a-f]{16,128}$")
_LAYOUT_NAME = re.compile(r"^v[0-9]+$")
#: entries live under a folder named for the format, so a future layout
#: never reads this one's files (and ``prune`` can drop old layouts whole)
_LAYOUT = f"v{FORMAT}"
_SUFFIX = ".bin"
#: ``prune`` leaves the store at this share of its bound, so a busy store
#: does not scan its whole directory on every write
_PRUNE_TO = 0.9


class StoreError(ValueError):
    """A key or setting the store cannot accept (bad input, raised before any I/O)."""


@dataclass
class StoreCounters:
    hits: int = 0
    misses: int = 0
    writes: int = 0
    evictions: int = 0
    #: entries that failed verification (deleted, then a miss)
    corrupt: int = 0
    #: reads or writes that failed with an OS error
    errors: int = 0
    bytes_read: int = 0
    bytes_written: int = 0


class Store:
    """Blobs by key in *root*, at most *max_bytes* of entries (least recently used evicted)."""

    def __init__(self, root: str | os.PathLike[str], max_bytes: int) -> None:
        if max_bytes < 0:
            raise StoreError(f"max_bytes must be >= 0, got {max_bytes}")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.counters = StoreCounters()
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._writable = True
        #: bytes this process believes the store holds; None until first scanned
        self._estimate: int | None = None

    # -- reads ---------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        """The verified payload stored under *key*, or None (a miss).

        A ``bytes`` object read whole, never a slice copy nor a memoryview:
        outlines_core's ``from_binary`` takes a memoryview several times slower.
        """
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as fh:
                payload = _read_verified(fh, key)
        except FileNotFoundError:
            self._count(misses=1)
            return None
        except OSError as err:
            self._count(misses=1, errors=1)
            self._warn_once("read", f"cannot read {path} ({err}); treated as a miss")
            return None
        if payload is None:
            self._count(misses=1, corrupt=1)
            self._warn_once(f"corrupt:{key}", f"store entry {path} failed verification; deleted, will be rebuilt")
            self._unlink(path)
            return None
        self._count(hits=1, bytes_read=len(payload))
        try:  # the entry's mtime is its recency for eviction
            os.utime(path)
        except OSError:
            pass  # a read-only store still serves
        return payload

    def discard(self, key: str, why: str) -> None:
        """Delete an entry its reader could not use (a verified file in a foreign format): counted corrupt."""
        path = self._path(key)
        self._count(corrupt=1, hits=-1, misses=1)
        self._warn_once(f"corrupt:{key}", f"store entry {path}: {why}; deleted, will be rebuilt")
        self._unlink(path)

    # -- writes --------------------------------------------------------
    def put(self, key: str, payload: bytes) -> bool:
        """Store *payload* under *key* atomically; False if the store cannot take it."""
        path = self._path(key)
        size = _HEADER.size + len(payload)
        if not self._writable or size > self.max_bytes:
            return False
        header = _HEADER.pack(MAGIC, FORMAT, len(payload), _sha(key.encode()), _digest(memoryview(payload)))
        try:
            for folder in (self.root, path.parent.parent, path.parent):  # owner-only, each level
                if not folder.is_dir():
                    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=_SUFFIX, dir=path.parent)
        except OSError as err:
            self._write_failed(err)
            return False
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(header)
                fh.write(payload)
            os.replace(tmp, path)
        except OSError as err:
            self._unlink(Path(tmp))
            self._write_failed(err)
            return False
        self._count(writes=1, bytes_written=size)
        with self._lock:
            if self._estimate is not None:
                self._estimate += size
            over = self._estimate is None or self._estimate > self.max_bytes
        if over:
            self.prune()
        return True

    def _write_failed(self, err: OSError) -> None:
        self._count(errors=1)
        self._writable = False
        self._warn_once("write", f"cannot write to {self.root} ({err}); compiled grammars stay in memory only")

    # -- maintenance ---------------------------------------------------
    def entries(self) -> Iterator[tuple[Path, int, float]]:
        """(path, size, mtime) of every entry file of this layout."""
        yield from self._entries(self.root / _LAYOUT)

    def _all_entries(self) -> Iterator[tuple[Path, int, float]]:
        """Entries of every layout, this one's and those of other versions of the package.

        Eviction weighs them together: an older layout's files are never read
        by this version, so they stop being touched and go first, while a
        process of the older version that still shares the store keeps its
        own recent entries alive.
        """
        try:
            layouts = [d.path for d in os.scandir(self.root)
                       if d.is_dir(follow_symlinks=False) and _LAYOUT_NAME.match(d.name)]
        except OSError:
            return
        for layout in layouts:
            yield from self._entries(Path(layout))

    @staticmethod
    def _entries(base: Path) -> Iterator[tuple[Path, int, float]]:
        try:
            shards = list(os.scandir(base))
        except OSError:
            return
        for shard in shards:
            if not shard.is_dir(follow_symlinks=False):
                continue
            try:
                files = list(os.scandir(shard.path))
            except OSError:
                continue
            for entry in files:
                if not entry.name.endswith(_SUFFIX) or entry.name.startswith(".tmp-"):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                yield Path(entry.path), st.st_size, st.st_mtime

    def prune(self, max_bytes: int | None = None) -> int:
        """Evict least recently used entries until the store fits; return how many went."""
        bound = self.max_bytes if max_bytes is None else max_bytes
        listing = sorted(self._all_entries(), key=lambda e: e[2])
        total = sum(size for _, size, _ in listing)
        evicted = 0
        if total > bound:
            goal = int(bound * _PRUNE_TO)
            for path, size, _ in listing:
                if total <= goal:
                    break
                if self._unlink(path):
                    evicted += 1
                total -= size
        self._sweep_temporaries()
        with self._lock:
            self._estimate = total
            self.counters.evictions += evicted
        return evicted

    def _sweep_temporaries(self, older_than: float = 3600.0) -> None:
        """Delete temporary files a killed writer left (never a live writer's: they are young)."""
        base = self.root / _LAYOUT
        now = time.time()
        try:
            shards = [s.path for s in os.scandir(base) if s.is_dir(follow_symlinks=False)]
        except OSError:
            return
        for shard in shards:
            try:
                for entry in os.scandir(shard):
                    if entry.name.startswith(".tmp-") and now - entry.stat().st_mtime > older_than:
                        self._unlink(Path(entry.path))
            except OSError:
                continue

    def clear(self) -> int:
        """Delete every entry; return how many."""
        return self.prune(max_bytes=-1)

    def info(self) -> dict[str, Any]:
        listing = list(self.entries())
        return {
            "root": str(self.root),
            "layout": _LAYOUT,
            "entries": len(listing),
            "bytes": sum(size for _, size, _ in listing),
            "max_bytes": self.max_bytes,
            "writable": self._writable and os.access(self.root, os.W_OK) if self.root.exists() else False,
        }

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return dict(asdict(self.counters), root=str(self.root), writable=self._writable)

    def reset_counters(self) -> None:
        with self._lock:
            self.counters = StoreCounters()
            self._warned.clear()

    # -- helpers -------------------------------------------------------
    def _path(self, key: str) -> Path:
        if not isinstance(key, str) or not _KEY.match(key):
            raise StoreError(f"store keys are 16-128 lowercase hex digits, got {key!r}")
        return self.root / _LAYOUT / key[:2] / (key[2:] + _SUFFIX)

    def _unlink(self, path: Path) -> bool:
        try:
            path.unlink()
            return True
        except OSError:
            return False

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                setattr(self.counters, name, getattr(self.counters, name) + n)

    def _warn_once(self, tag: str, message: str) -> None:
        with self._lock:
            if tag in self._warned:
                return
            self._warned.add(tag)
        log.warning("outlines_maskcache store: %s", message)

    def after_fork(self) -> None:
        self._lock = threading.Lock()


def _sha(data: bytes | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


def _digest(payload: memoryview) -> bytes:
    """The header's payload digest: sha256 over the sha256 of each ``_CHUNK`` slice, computed in one thread."""
    return _sha(b"".join(_sha(payload[at:at + _CHUNK]) for at in range(0, len(payload), _CHUNK)))


def _read_verified(fh: Any, key: str) -> bytes | None:
    """The payload of an open entry if its header is ours, of this format and of *key*, and its length and digest match.

    The header is checked before the payload is read, and its length against
    the file's size, so a foreign or damaged file costs no payload read.  The
    digest is computed over the very bytes returned, never over a second read.
    """
    header = fh.read(_HEADER.size)
    if header is None or len(header) < _HEADER.size:
        return None
    magic, fmt, length, key_sha, payload_digest = _HEADER.unpack_from(header)
    if magic != MAGIC or fmt != FORMAT or key_sha != _sha(key.encode()):
        return None  # not ours, another layout, or a valid entry of another key copied here
    if os.fstat(fh.fileno()).st_size != _HEADER.size + length:
        return None  # truncated or appended to
    readers = min(_cpus(), -(-length // _CHUNK), _MAX_READERS)
    if readers > 1 and _fresh_bytes is not None and hasattr(os, "preadv"):
        payload, digest = _read_in_parallel(fh.fileno(), _HEADER.size, length, readers)
    else:
        payload = fh.readall()  # unbuffered: one read into the result, no joined buffer
        digest = _digest(memoryview(payload)) if len(payload) == length else None
    if payload is None or digest != payload_digest:
        return None
    return payload


class _ShortRead(Exception):
    """The file ended before the length its header and size promised (it changed under the reader)."""


def _read_in_parallel(fd: int, offset: int, length: int, readers: int) -> tuple[bytes | None, bytes | None]:
    """Read *length* bytes at *offset* into a new ``bytes`` and digest them, *readers* threads sharing the chunks.

    A ``bytes`` filled in place, because ``from_binary`` takes ``bytes`` (or a
    bytearray) fast and other buffers several times slower, while
    ``bytearray(n)`` zeroes every page under the GIL before the read starts:
    here each thread faults, reads and hashes its own chunks.  Each thread
    holds a reference to the result, so it outlives an interrupted caller.
    """
    payload, view = _fresh_bytes(length)  # type: ignore[misc]
    starts = range(0, length, _CHUNK)
    digests: list[bytes] = [b""] * len(starts)
    failures: list[BaseException] = []

    def read_share(first: int, _keep: bytes) -> None:
        try:
            for k in range(first, len(starts), readers):
                chunk = view[starts[k]:starts[k] + _CHUNK]
                done = 0
                while done < len(chunk):
                    got = os.preadv(fd, [chunk[done:]], offset + starts[k] + done)
                    if got <= 0:
                        raise _ShortRead
                    done += got
                digests[k] = _sha(chunk)
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread below
            failures.append(err)

    helpers = []
    for share in range(1, readers):
        thread = threading.Thread(target=read_share, args=(share, payload), daemon=True,
                                  name="outlines-maskcache-store-read")
        try:
            thread.start()
        except RuntimeError:  # no new thread (e.g. at interpreter shutdown, saving masks): read it here
            read_share(share, payload)
            continue
        helpers.append(thread)
    read_share(0, payload)
    for thread in helpers:
        thread.join()
    for err in failures:
        if isinstance(err, OSError):
            raise err  # counted by ``get`` like any failed read: a miss, the entry kept
        if not isinstance(err, _ShortRead):
            raise OSError(f"store read failed in a reader thread: {err!r}") from err
    if failures:
        return None, None
    return payload, _sha(b"".join(digests))


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _uninitialised_bytes() -> Callable[[int], tuple[bytes, memoryview]] | None:
    """A maker of a new, unfilled ``bytes`` of n bytes and a writable view of it, or None where the C API is not at hand.

    ``PyBytes_FromStringAndSize(NULL, n)`` is the C API's documented way to
    make a bytes object to fill before anyone else sees it (CPython's own
    ``readall`` does so); it allocates without touching the pages.  Private
    prototypes, so no other user of ``ctypes.pythonapi`` sees changed types.
    """
    try:
        import ctypes

        new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_ssize_t)(
            ("PyBytes_FromStringAndSize", ctypes.pythonapi))
        address = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object)(("PyBytes_AsString", ctypes.pythonapi))
    except (ImportError, AttributeError, OSError):
        return None

    def fresh(n: int) -> tuple[bytes, memoryview]:
        made = new(None, n)
        return made, memoryview((ctypes.c_ubyte * n).from_address(address(made))).cast("B")

    return fresh


_fresh_bytes = _uninitialised_bytes()


def default_root() -> Path:
    """The platform's user cache directory (XDG on Linux, Library/Caches on macOS, LOCALAPPDATA on Windows)."""
    if os.name == "nt":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    elif os.uname().sysname == "Darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "outlines-maskcache" / "store"
