"""The persistent grammar store: verified reads, atomic writes, eviction, degradation, sharing across processes.

The store core is tested on bytes (it knows nothing about outlines); the
integration tests go through outlines' own backend with the real GPT-2
tokenizer and check that what the store serves equals a fresh compile on
walks, and that every fault is a miss that recompiles, never a wrong mask.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

import outlines_maskcache as mc
from outlines_maskcache.store import _HEADER, Store, StoreError

KEY = "ab" * 32
OTHER = "cd" * 32


@pytest.fixture()
def store(tmp_path) -> Store:
    return Store(tmp_path / "store", 1 << 20)


def _entry(store: Store, key: str = KEY) -> Path:
    return store._path(key)


# -- the core, on bytes --------------------------------------------------------

def test_round_trip_and_owner_only_permissions(store):
    assert store.get(KEY) is None
    assert store.put(KEY, b"payload")
    assert store.get(KEY) == b"payload"
    for folder in (store.root, _entry(store).parent.parent, _entry(store).parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    assert stat.S_IMODE(_entry(store).stat().st_mode) == 0o600
    c = store.counters
    assert (c.hits, c.misses, c.writes, c.corrupt) == (1, 1, 1, 0)


@pytest.mark.parametrize("bad", ["", "ABCDEF0123456789", "../" + "a" * 20, "a" * 15, "a" * 129, "g" * 32, None])
def test_bad_keys_are_rejected_before_any_io(store, bad):
    with pytest.raises(StoreError):
        store.get(bad)
    with pytest.raises(StoreError):
        store.put(bad, b"x")
    assert not store.root.exists()


def _corrupt(kind: str, path: Path) -> None:
    data = bytearray(path.read_bytes())
    if kind == "truncated":
        path.write_bytes(bytes(data[: len(data) - 3]))
    elif kind == "header-only":
        path.write_bytes(bytes(data[: _HEADER.size - 1]))
    elif kind == "zero-length":
        path.write_bytes(b"")
    elif kind == "flipped-payload":
        data[-1] ^= 0x40
        path.write_bytes(bytes(data))
    elif kind == "foreign-format":
        data[8] += 1  # the format field after the magic
        path.write_bytes(bytes(data))
    elif kind == "bad-magic":
        path.write_bytes(b"X" + bytes(data[1:]))
    elif kind == "appended":
        path.write_bytes(bytes(data) + b"tail")
    elif kind == "pickle":
        import pickle

        path.write_bytes(pickle.dumps({"os.system": "echo pwned"}))
    else:  # pragma: no cover
        raise ValueError(kind)


CORRUPTIONS = ["truncated", "header-only", "zero-length", "flipped-payload", "foreign-format", "bad-magic", "appended", "pickle"]


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_corrupt_entries_are_misses_deleted_and_counted(store, kind, caplog):
    store.put(KEY, b"the real payload" * 100)
    _corrupt(kind, _entry(store))
    with caplog.at_level("WARNING", logger="outlines_maskcache"):
        assert store.get(KEY) is None
        assert store.get(KEY) is None  # deleted: now a plain miss, not logged again
    assert store.counters.corrupt == 1
    assert not _entry(store).exists()
    assert sum("failed verification" in r.getMessage() for r in caplog.records) == 1


def test_a_header_whose_length_contradicts_the_file_is_a_miss(store):
    store.put(KEY, b"small")
    data = bytearray(_entry(store).read_bytes())
    magic, fmt, _, key_sha, payload_sha = _HEADER.unpack_from(data)
    data[: _HEADER.size] = _HEADER.pack(magic, fmt, 1 << 60, key_sha, payload_sha)
    _entry(store).write_bytes(bytes(data))
    assert store.get(KEY) is None
    assert store.counters.corrupt == 1


def test_an_entry_renamed_to_another_key_is_foreign(store):
    store.put(KEY, b"payload of KEY")
    target = _entry(store, OTHER)
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(_entry(store), target)
    assert store.get(OTHER) is None
    assert store.counters.corrupt == 1


def test_unreadable_entry_is_a_miss(store):
    store.put(KEY, b"x")
    path = _entry(store)
    path.unlink()
    path.mkdir()  # reading a directory raises IsADirectoryError
    assert store.get(KEY) is None
    assert store.counters.errors == 1


def test_read_only_store_still_serves_and_stops_writing(store, monkeypatch, caplog):
    store.put(KEY, b"baked into an image")
    real_mkstemp = __import__("tempfile").mkstemp

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr("tempfile.mkstemp", denied)
    with caplog.at_level("WARNING", logger="outlines_maskcache"):
        assert not store.put(OTHER, b"new")
        assert not store.put(OTHER, b"new")
    assert store.get(KEY) == b"baked into an image"
    assert store.counters.errors == 1, "writes stop after the first failure"
    assert sum("cannot write" in r.getMessage() for r in caplog.records) == 1
    monkeypatch.setattr("tempfile.mkstemp", real_mkstemp)


def test_full_disk_leaves_no_partial_entry(store, monkeypatch):
    real_fdopen = os.fdopen

    class Full:
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def write(self, data):
            self.fh.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fdopen", lambda fd, mode: Full(real_fdopen(fd, mode)))
    assert not store.put(KEY, b"y" * 10_000)
    monkeypatch.setattr(os, "fdopen", real_fdopen)
    assert store.get(KEY) is None
    assert list(_entry(store).parent.iterdir()) == [], "the temporary file must be removed"


def test_missing_parent_that_cannot_be_created(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    store = Store(blocker / "store", 1 << 20)
    assert store.get(KEY) is None  # NotADirectoryError: a miss, counted as an error
    assert not store.put(KEY, b"x")
    assert store.counters.errors == 2 and not store.snapshot()["writable"]


def test_eviction_keeps_the_most_recently_used_under_a_tiny_bound(tmp_path):
    import time

    store = Store(tmp_path / "s", 4 * (_HEADER.size + 1000))
    keys = [f"{i:02x}" * 32 for i in range(10)]
    for i, key in enumerate(keys):
        assert store.put(key, bytes([i]) * 1000)
        time.sleep(0.02)  # distinct mtimes: recency is the file's mtime
        if i >= 3:
            assert store.get(keys[0]) == bytes([0]) * 1000, "a read makes it most recent: never evicted"
            time.sleep(0.02)
    info = store.info()
    assert info["bytes"] <= store.max_bytes
    assert store.counters.evictions >= 6
    assert store.get(keys[-1]) == bytes([9]) * 1000
    assert store.get(keys[1]) is None and store.get(keys[5]) is None
    assert store.clear() == info["entries"]
    assert store.info()["entries"] == 0


def test_entry_larger_than_the_bound_is_not_written(tmp_path):
    store = Store(tmp_path / "s", 100)
    assert not store.put(KEY, b"z" * 200)
    assert store.info()["entries"] == 0


def test_threads_writing_and_reading_one_key(store):
    payload = os.urandom(200_000)
    errors: list[BaseException] = []

    def work():
        try:
            for _ in range(30):
                store.put(KEY, payload)
                got = store.get(KEY)
                assert got is None or got == payload
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert store.counters.corrupt == 0
    assert store.get(KEY) == payload


# -- large entries: read and verified by several threads ----------------------

from outlines_maskcache import store as store_module  # noqa: E402

#: three full chunks and a short fourth: every reader thread has work, and the last chunk is partial
BIG = 3 * store_module._CHUNK + 12_345


@pytest.fixture()
def big_store(tmp_path, monkeypatch) -> Store:
    monkeypatch.setattr(store_module, "_cpus", lambda: 3)  # more readers than this machine may have cores
    return Store(tmp_path / "big", 64 << 20)


def test_large_entry_round_trips_through_parallel_and_single_thread_reads(big_store, monkeypatch):
    payload = os.urandom(BIG)
    assert big_store.put(KEY, payload)
    calls: list[int] = []
    real = store_module._read_in_parallel
    monkeypatch.setattr(store_module, "_read_in_parallel",
                        lambda *a: calls.append(a[-1]) or real(*a))
    got = big_store.get(KEY)
    assert type(got) is bytes and got == payload  # bytes: outlines_core's from_binary takes it fast
    assert calls == [3], "a multi-chunk entry is read by several threads"
    monkeypatch.setattr(store_module, "_cpus", lambda: 1)
    assert big_store.get(KEY) == payload  # the digest does not depend on how many threads computed it
    monkeypatch.setattr(store_module, "_fresh_bytes", None)  # an interpreter without the C API: one thread
    monkeypatch.setattr(store_module, "_cpus", lambda: 3)
    assert big_store.get(KEY) == payload
    assert calls == [3]
    assert big_store.counters.corrupt == 0


def test_a_large_read_where_no_thread_can_start_is_done_by_the_caller(big_store, monkeypatch):
    """At interpreter shutdown (the exit-time save of mask rows reads the store) no new thread starts."""
    payload = os.urandom(BIG)
    big_store.put(KEY, payload)

    def refuse(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(store_module.threading.Thread, "start", refuse)
    assert big_store.get(KEY) == payload
    assert big_store.counters.errors == 0


@pytest.mark.parametrize("where", [0, store_module._CHUNK + 5, BIG - 1], ids=["first-chunk", "second-chunk", "last-byte"])
def test_a_flipped_byte_in_any_chunk_of_a_large_entry_is_a_miss(big_store, where):
    payload = os.urandom(BIG)
    big_store.put(KEY, payload)
    path = _entry(big_store)
    with open(path, "r+b") as fh:
        fh.seek(_HEADER.size + where)
        byte = fh.read(1)
        fh.seek(_HEADER.size + where)
        fh.write(bytes([byte[0] ^ 0x01]))
    assert big_store.get(KEY) is None
    assert big_store.counters.corrupt == 1 and not path.exists()


def test_a_file_that_ends_early_during_a_parallel_read_is_a_miss(big_store, monkeypatch):
    """The size check passed, then a chunk read hits the end of the file (it changed under the reader)."""
    big_store.put(KEY, os.urandom(BIG))
    real = os.preadv

    def ends_early(fd, buffers, offset):
        return 0 if offset >= _HEADER.size + 2 * store_module._CHUNK else real(fd, buffers, offset)

    monkeypatch.setattr(store_module.os, "preadv", ends_early)
    assert big_store.get(KEY) is None
    assert big_store.counters.corrupt == 1


@pytest.mark.parametrize("error", [OSError(errno.EIO, "I/O error"), RuntimeError("a bug")], ids=["EIO", "unexpected"])
def test_a_read_error_in_a_helper_thread_is_a_counted_miss(big_store, monkeypatch, error):
    payload = os.urandom(BIG)
    big_store.put(KEY, payload)
    real = os.preadv

    def fails_on_chunk_one(fd, buffers, offset):
        if offset == _HEADER.size + store_module._CHUNK:  # chunk 1 is a helper thread's with 3 readers
            raise error
        return real(fd, buffers, offset)

    monkeypatch.setattr(store_module.os, "preadv", fails_on_chunk_one)
    assert big_store.get(KEY) is None
    assert (big_store.counters.errors, big_store.counters.corrupt) == (1, 0)
    monkeypatch.setattr(store_module.os, "preadv", real)
    assert big_store.get(KEY) == payload, "an I/O error is not corruption: the entry stays"


def test_entries_of_an_older_layout_are_never_read_and_are_evicted_first(tmp_path):
    import time

    store = Store(tmp_path / "s", 3 * (_HEADER.size + 1000))
    old = store.root / "v1" / KEY[:2] / (KEY[2:] + ".bin")
    old.parent.mkdir(parents=True)
    old.write_bytes(b"an entry of the format-1 layout" * 40)
    time.sleep(0.02)
    assert store.get(KEY) is None and store.counters.corrupt == 0  # another layout's folder: not looked at
    keys = [f"{i:02x}" * 32 for i in range(1, 4)]
    for key in keys:
        assert store.put(key, b"n" * 1000)
        time.sleep(0.02)
    assert not old.exists(), "the old layout's file was the least recently used"
    assert all(store.get(key) for key in keys[1:])
    store.root.joinpath("v1", "ef").mkdir()
    store.root.joinpath("v1", "ef", "cd" * 31 + ".bin").write_bytes(b"x")
    store.clear()
    assert not list(store._all_entries())


# -- through outlines ------------------------------------------------------------

outlines_core_backend = pytest.importorskip("outlines.backends.outlines_core", reason="outlines >= 1.2 backend")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def model(gpt2_outlines_model):
    return gpt2_outlines_model


@pytest.fixture(autouse=True)
def _full_compiles():
    """These tests count the store's entries (a vocabulary and an Index): no lazy Index, whose token table is a third
    (tests/test_lazy_first_use.py covers the store with it)."""
    mc.configure(lazy_index=False)


def _processor(model, schema=SCHEMA):
    """The processor, once the background thread is done (a lazy Index handed over, store writes made)."""
    from outlines_maskcache.runtime import RUNTIME

    backend = outlines_core_backend.OutlinesCoreBackend(model)
    processor = backend.get_json_schema_logits_processor(json.dumps(schema))
    RUNTIME.settle()
    return processor


def _walk_equal(index_a, index_b, steps: int = 200) -> int:
    """Both Indexes allow the same tokens in every state reached on a deterministic walk."""
    from outlines_core import Guide

    a, b = Guide(index_a), Guide(index_b)
    seen = 0
    for step in range(steps):
        assert sorted(a.get_tokens()) == sorted(b.get_tokens()), f"allowed tokens differ at step {step}"
        assert a.is_finished() == b.is_finished()
        tokens = sorted(a.get_tokens())
        if a.is_finished() or not tokens:
            break
        token = tokens[(step * 7919) % len(tokens)]
        a.advance(token, False)
        b.advance(token, False)
        seen += 1
    return seen


def test_processor_from_store_equals_fresh_compile(model, tmp_path):
    from outlines_core import Index
    from outlines_core.json_schema import build_regex_from_schema

    mc.configure(store=str(tmp_path / "s"))
    first = _processor(model)
    assert mc.stats()["store"]["writes"] == 2  # the vocabulary and the Index
    mc.clear()
    second = _processor(model)
    stats = mc.stats()["store"]
    assert stats["hits"] == 2 and stats["corrupt"] == 0
    assert second.index is not first.index
    with mc.disabled():  # stock's own vocabulary conversion and compile
        fresh = Index(build_regex_from_schema(json.dumps(SCHEMA)), outlines_core_backend.OutlinesCoreBackend(model).vocabulary)
    assert _walk_equal(second.index, fresh) > 5


@pytest.mark.parametrize("kind", ["truncated", "flipped-payload", "zero-length", "foreign-format"])
def test_corrupt_stored_index_is_recompiled_not_served(model, tmp_path, kind):
    root = tmp_path / "s"
    mc.configure(store=str(root))
    reference = _processor(model).index
    entries = sorted(Store(root, 1 << 40).entries(), key=lambda e: e[1])
    for path, _, _ in entries:
        _corrupt(kind, path)
    mc.clear()
    mc.reset_stats()
    again = _processor(model)
    stats = mc.stats()
    assert stats["store"]["corrupt"] == 2 and stats["store"]["writes"] == 2, stats["store"]
    assert _walk_equal(again.index, reference) > 5
    mc.clear()
    mc.reset_stats()
    _processor(model)
    assert mc.stats()["store"]["hits"] == 2, "the rebuilt entries are served next time"


def test_verified_entry_that_does_not_load_is_rebuilt(model, tmp_path):
    """A well-formed file whose payload is not outlines_core's format (e.g. another version's bytes)."""
    root = tmp_path / "s"
    mc.configure(store=str(root))
    _processor(model)
    store = Store(root, 1 << 40)
    for path, _, _ in list(store.entries()):
        key = path.parent.name + path.name[: -len(".bin")]
        assert store.put(key, b"\x00not bincode\xff" * 10)
    mc.clear()
    mc.reset_stats()
    processor = _processor(model)
    stats = mc.stats()
    assert stats["store"]["corrupt"] == 2 and stats["fallbacks"] == 0
    assert processor.index is not None


def test_store_off_and_read_only(model, tmp_path, monkeypatch):
    mc.configure(store=False)
    _processor(model)
    assert mc.stats()["store"] is None
    root = tmp_path / "ro"
    mc.configure(store=str(root))
    mc.clear()
    _processor(model)  # fills it
    monkeypatch.setattr("tempfile.mkstemp", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EROFS, "Read-only file system")))
    mc.clear()
    mc.reset_stats()
    _processor(model, {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]})
    stats = mc.stats()["store"]
    assert stats["hits"] == 1 and stats["errors"] == 1 and stats["writable"] is False


def test_environment_turns_the_store_off_or_moves_it(tmp_path):
    from outlines_maskcache.config import settings_from_env

    assert settings_from_env({"OUTLINES_MASKCACHE_STORE": "0"}).store is None
    assert settings_from_env({"OUTLINES_MASKCACHE_STORE": str(tmp_path)}).store == str(tmp_path)
    assert settings_from_env({}).store == "auto"
    assert settings_from_env({"OUTLINES_MASKCACHE_STORE_MAX_BYTES": "1G"}).store_max_bytes == 10**9
    with pytest.raises(mc.ConfigError):
        mc.configure(store="")
    with pytest.raises(mc.ConfigError):
        mc.configure(store_max_bytes=-1)


_CHILD = textwrap.dedent("""
    import json, sys
    import outlines_maskcache as mc
    import outlines
    from outlines.backends.outlines_core import OutlinesCoreBackend
    sys.path.insert(0, sys.argv[3])
    from support.material import gpt2_tokenizer, tiny_model
    # counted: a vocabulary and an Index (no token table), unless the lazy Index is asked for
    mc.configure(store=sys.argv[1], lazy_index=len(sys.argv) > 4 and sys.argv[4] == "lazy")
    tok = gpt2_tokenizer()
    model = outlines.from_transformers(tiny_model(tok), tok)
    processor = OutlinesCoreBackend(model).get_json_schema_logits_processor(sys.argv[2])
    import torch
    ids = torch.tensor([[tok.eos_token_id]])
    allowed = []
    for step in range(6):  # a fixed walk: each step takes the smallest allowed token
        out = processor(ids, torch.zeros(1, len(tok)))
        finite = torch.isfinite(out[0]).nonzero().flatten()
        allowed.append(int(finite.numel()))
        ids = torch.cat([ids, finite[:1].view(1, 1)], dim=1)
    # No explicit save: the exit hook saves the mask rows the next process reads.
    print(json.dumps({"stats": mc.stats(), "allowed": allowed}))
""")


def _child(root: Path, schema: dict, *more: str) -> dict:
    here = Path(__file__).resolve().parent
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(root), json.dumps(schema), str(here), *more],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_process_compiles_nothing(tmp_path):
    pytest.importorskip("torch", reason="the child builds a transformers model (torch-free session)")
    root = tmp_path / "shared"
    first = _child(root, SCHEMA)
    second = _child(root, SCHEMA)
    assert first["stats"]["store"]["writes"] == 2 and first["stats"]["store"]["hits"] == 0
    assert second["stats"]["store"]["hits"] == 3  # vocabulary, Index, mask rows
    assert second["stats"]["store"]["misses"] == 0
    assert second["allowed"] == first["allowed"] and min(first["allowed"]) > 0
    # No compile and no write_mask_into: every row came from the first process's persisted masks.
    assert first["stats"].get("mask_writes", 0) >= 6
    assert second["stats"].get("mask_writes", 0) == 0, second["stats"]
    assert second["stats"]["persisted_rows"] >= 6


def test_a_script_served_lazily_leaves_its_index_for_the_next_run(tmp_path):
    pytest.importorskip("torch", reason="the child builds a transformers model (torch-free session)")
    root = tmp_path / "shared"
    first = _child(root, SCHEMA, "lazy")
    second = _child(root, SCHEMA, "lazy")
    assert first["stats"]["lazy_index"]["served"] == 1
    # Exit waited for the full compile behind the lazy Index and its store write.
    assert second["stats"]["lazy_index"]["served"] == 0 and second["stats"]["store"]["misses"] == 0
    assert second["allowed"] == first["allowed"]


def test_concurrent_processes_fill_one_store(tmp_path):
    """Processes compiling the same and different schemas into one directory at once."""
    pytest.importorskip("torch", reason="the children build a transformers model (torch-free session)")
    root = tmp_path / "shared"
    schemas = [SCHEMA, SCHEMA, {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}]
    here = Path(__file__).resolve().parent
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(root), json.dumps(s), str(here)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for s in schemas]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["stats"]["store"]["corrupt"] == 0 for r in results)
    assert results[0]["allowed"] == results[1]["allowed"]
    store = Store(root, 1 << 40)
    assert store.info()["entries"] == 5  # one vocabulary, two Indexes, their mask rows
    for path, _, _ in store.entries():
        key = path.parent.name + path.name[: -len(".bin")]
        assert store.get(key) is not None, "every entry left behind verifies"
    again = _child(root, schemas[2])
    assert again["stats"]["store"]["hits"] == 3 and again["stats"].get("mask_writes", 0) == 0


# -- the equivalence property, with grammars and masks from the store -----------

from hypothesis import assume, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from support.drivers import walk  # noqa: E402
from support.strategies import regexes, vocabularies  # noqa: E402


@given(regex=regexes(), vocab=vocabularies(), seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 6),
       extra=st.integers(0, 20))
def test_stored_grammars_and_persisted_masks_equal_stock(regex, vocab, seed, batch, extra):
    """Stock on a fresh compile vs cached on an Index loaded from the store, then again on persisted rows."""
    import numpy as np
    from outlines_core import Index, Vocabulary

    from outlines_maskcache import compiled
    from outlines_maskcache.fingerprint import digest
    from outlines_maskcache.persisted_masks import PERSISTED
    from outlines_maskcache.runtime import RUNTIME

    tokens, eos, n_ids = vocab
    try:
        fresh = Index(regex, Vocabulary(eos, tokens))
    except (ValueError, RuntimeError):
        assume(False)
    name = digest("hypothesis", regex, sorted(tokens.items()), eos)

    def from_store():
        index = compiled.stored("index", (name,), lambda: Index(regex, Vocabulary(eos, tokens)), Index.from_binary)
        RUNTIME.grammars.register(index, name)  # a content name: its rows persist
        return index

    from_store()  # compiles and stores (on the background thread), unless an earlier example did
    RUNTIME.settle()
    for generation in range(2):  # 0: rows learned (and persisted); 1: a "new process" served from them
        mc.clear()
        before = mc.stats()["store"]["hits"]
        loaded = from_store()
        assert mc.stats()["store"]["hits"] == before + 1, "the Index must come from the store"
        from support.drivers import Lockstep

        walk(fresh, eos, np.random.default_rng(seed), batch=batch, steps=10, width=n_ids + extra,
             lockstep=Lockstep(fresh, cached_index=loaded))
        PERSISTED.save_all()
    stats = mc.stats()
    assert stats["fallbacks"] == 0 and stats["store"]["corrupt"] == 0


class _WordsGuide:
    """Just what ``words_of`` uses of an outlines_core Guide: a state and stock's bitmask write."""

    def __init__(self, state: int) -> None:
        self.state = state

    def get_state(self) -> int:
        return self.state

    def write_mask_into(self, address: int, n_words: int, itemsize: int) -> None:
        import ctypes

        row = (ctypes.c_int32 * n_words).from_address(address)
        for i in range(n_words):
            row[i] = (self.state * 2654435761 + i) & 0x7FFFFFFF


def test_mask_rows_are_saved_off_the_decoding_thread_and_reloaded(tmp_path, monkeypatch):
    import numpy as np

    from outlines_maskcache import persisted_masks
    from outlines_maskcache.persisted_masks import PERSISTED, words_of

    mc.configure(store=str(tmp_path / "store"))
    saved_on = []
    real_save = PERSISTED._save
    monkeypatch.setattr(PERSISTED, "_save", lambda rows: (saved_on.append(threading.current_thread().name),
                                                          real_save(rows)))
    fingerprint = "vocab:" + "ef" * 32
    try:
        PERSISTED.clear()
        rows = [words_of(fingerprint, _WordsGuide(s), 8) for s in range(persisted_masks._SAVE_AFTER)]
        PERSISTED.save_all()  # waits for the save the last new row queued
        assert saved_on and saved_on[0] == "outlines_maskcache-store-writes"
        PERSISTED.clear()
        mc.reset_stats()
        again = [words_of(fingerprint, _WordsGuide(s), 8) for s in range(persisted_masks._SAVE_AFTER)]
        assert mc.stats()["persisted_rows"] == persisted_masks._SAVE_AFTER
        assert mc.stats().get("mask_writes", 0) == 0
        assert all(np.array_equal(a, b) for a, b in zip(rows, again))
    finally:
        PERSISTED.clear()
