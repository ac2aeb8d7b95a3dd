"""Nothing wrong ever reaches the logits: bad input, injected faults, threads, processes, memory pressure.

Figures (threads x steps, faults, schemas) are written to
``$MASKCACHE_REPORTS/reliability-*.json`` for docs/reliability.md.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import outlines_maskcache as mc
from conftest import nightly
from support.drivers import Lockstep, assert_bit_identical, walk
from support.versions import requires_outlines_core_backend

pytestmark = requires_outlines_core_backend

VOCAB = {"a": [0], "b": [1], "ab": [2], "ba": [3], "0": [4], "1": [5], "01": [6, 7], '"': [8], "a0": [9]}
EOS = 10
WIDTH = 16


def index(pattern: str = r"(ab|ba)+[01]{0,3}"):
    from outlines_core import Index, Vocabulary

    return Index(pattern, Vocabulary(EOS, VOCAB))


def report(name: str, data: dict) -> None:
    folder = os.environ.get("MASKCACHE_REPORTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        Path(folder, f"reliability-{name}.json").write_text(json.dumps(data, indent=2))


# -- bad input ------------------------------------------------------------------
BAD_INPUTS = {
    "3d logits": (torch.zeros(1, 1, 2, dtype=torch.long), torch.zeros(1, 1, WIDTH)),
    "batch mismatch": (torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, WIDTH)),
    "int logits": (torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, WIDTH, dtype=torch.int32)),
    "logits narrower than vocab": (torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 5)),
    "logits far wider than vocab": (torch.zeros(2, 2, dtype=torch.long), torch.randn(2, 1000)),
    "float64 logits": (torch.zeros(1, 2, dtype=torch.long), torch.randn(1, WIDTH, dtype=torch.float64)),
    "empty batch": (torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, WIDTH)),
}


_BAD_INPUT_OUTCOMES: dict[str, str] = {}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_behaves_exactly_like_stock(case):
    """Each bad input raises what stock raises, or gives stock's output; never a different mask."""
    ids, logits = BAD_INPUTS[case]
    pair = Lockstep(index())
    for _ in range(2):
        stock, cached, err = pair.step(ids, logits)  # asserts equal exception types
        if err is not None:
            break
        if stock.is_floating_point():
            assert_bit_identical(stock, cached, case)
        else:
            assert torch.equal(stock, cached)
        ids = torch.cat([ids, torch.zeros(ids.shape[0], 1, dtype=torch.long)], dim=1) if ids.dim() == 2 else ids
    _BAD_INPUT_OUTCOMES[case] = f"same error as stock: {type(err).__name__}" if err is not None else "same output as stock"
    report("bad-input", _BAD_INPUT_OUTCOMES)


# -- faults ---------------------------------------------------------------------
def _inject(monkeypatch, where: str, error: BaseException, after: int = 0):
    """Make a kernel function raise *error* after *after* successful calls."""
    from outlines_maskcache.kernels import torch as torch_kernel

    original = getattr(torch_kernel.TorchKernel, where)
    calls = {"n": 0}

    def faulty(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > after:
            raise error
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch_kernel.TorchKernel, where, faulty)
    return calls


FAULTS = {
    "allocation failure building a row": ("row", MemoryError("simulated allocation failure"), 0),
    "device OOM building a row": ("row", torch.OutOfMemoryError("CUDA out of memory (simulated)"), 1),
    "failure applying the batch": ("apply", RuntimeError("simulated kernel failure"), 2),
    "failure validating an entry": ("valid", RuntimeError("simulated metadata read failure"), 0),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_faults_fall_back_to_stock_and_are_counted_and_logged_once(fault, monkeypatch, caplog):
    where, error, after = FAULTS[fault]
    mc.clear()
    shared = index()
    # Warm entries of this grammar first: the new processors below find them
    # cached but have never validated them, so every kind of step runs.
    walk(shared, EOS, np.random.default_rng(1), batch=2, steps=3, width=WIDTH)
    _inject(monkeypatch, where, error, after)
    mc.reset_stats()
    before = mc.stats()["fallbacks"]
    with caplog.at_level(logging.WARNING, logger="outlines_maskcache"):
        walk(shared, EOS, np.random.default_rng(2), batch=4, steps=12, width=WIDTH)
    fallbacks = mc.stats()["fallbacks"] - before
    assert fallbacks > 0
    messages = [r for r in caplog.records if r.name == "outlines_maskcache"]
    assert len(messages) == 1 and type(error).__name__ in messages[0].getMessage()
    report(f"fault-{where}-{type(error).__name__}", {"fault": fault, "fallbacks": fallbacks, "mismatches": 0})


def test_a_half_applied_batch_is_repaired_by_stock(monkeypatch):
    """The apply step fails after masking some rows: stock re-masks and the result is stock's."""
    real_minimum = torch.minimum

    def half_then_fail(logits, other, *, out=None):
        if out is None or logits.dim() != 2 or logits.shape[0] < 2:
            return real_minimum(logits, other, out=out)
        half = logits.shape[0] // 2
        real_minimum(logits[:half], other[:half] if other.dim() == 2 else other, out=out[:half])
        raise RuntimeError("simulated failure mid-batch")

    monkeypatch.setattr(torch, "minimum", half_then_fail)
    walk(index(), EOS, np.random.default_rng(3), batch=6, steps=10, width=WIDTH)
    assert mc.stats()["fallbacks"] > 0


def test_a_slate_refresh_that_fails_half_way_is_redone_not_trusted(monkeypatch):
    """Mixed-state CPU batches keep a per-processor slate of rows; a copy into it that
    fails part way must not leave a row marked as holding a mask it does not hold."""
    real_copy = torch._foreach_copy_
    calls = {"n": 0}

    def flaky(dst, src):
        calls["n"] += 1
        if calls["n"] % 2 == 0:
            real_copy(dst[1:], src[1:])
            dst[0].fill_(float("inf"))  # a half-written row: every token "allowed"
            raise RuntimeError("simulated failure mid-copy")
        return real_copy(dst, src)

    monkeypatch.setattr(torch, "_foreach_copy_", flaky)
    # Rows loop before the 0, then after it: mixed states, a few changing per step.
    grammar = index(r"[ab]*0[ab]*")
    for seed in range(4):
        walk(grammar, EOS, np.random.default_rng(seed), batch=6, steps=16, width=WIDTH, specials=False, eos_bias=0.05)
    assert calls["n"] > 3 and mc.stats()["fallbacks"] > 0


def test_a_sparse_put_back_that_fails_is_repaired_before_stock_runs(monkeypatch):
    """Sparse rows are filled with -inf, then their allowed values put back; if the put-back
    fails the values are restored by a second route and stock's result is exact."""
    mc.configure(sparse_below=1.0)

    def failing(self, *args, **kwargs):
        raise RuntimeError("simulated index_copy_ failure")

    monkeypatch.setattr(torch.Tensor, "index_copy_", failing)
    walk(index(), EOS, np.random.default_rng(5), batch=4, steps=10, width=WIDTH)
    assert mc.stats()["fallbacks"] > 0


def test_a_sparse_row_that_cannot_be_restored_fails_the_step_instead_of_masking_garbage(monkeypatch):
    from outlines_maskcache.kernels import LogitsLost

    mc.configure(sparse_below=1.0)
    pair = Lockstep(index())
    ids = torch.zeros(2, 1, dtype=torch.long)
    pair.step(ids, torch.zeros(2, WIDTH))  # first step: guides set up, rows cached

    def failing(self, *args, **kwargs):
        raise RuntimeError("simulated write failure")

    monkeypatch.setattr(torch.Tensor, "index_copy_", failing)
    monkeypatch.setattr(torch.Tensor, "__setitem__", failing)
    ids = torch.cat([ids, torch.zeros(2, 1, dtype=torch.long)], dim=1)
    with pytest.raises(LogitsLost):
        pair.cached(ids, torch.randn(2, WIDTH))
    assert mc.stats()["fallbacks"] == 1


def test_corrupted_entry_metadata_is_rebuilt_not_served():
    pair = Lockstep(index())
    ids = torch.zeros(1, 1, dtype=torch.long)
    pair.step(ids, torch.zeros(1, WIDTH))
    cache = mc.runtime.RUNTIME.cache
    with cache._lock:
        for key, (value, size) in list(cache._entries.items()):
            cache._entries[key] = (value[:-1].to(torch.float16), size)  # wrong shape and dtype
    pair.reset()
    stock, cached, err = pair.step(ids, torch.randn(1, WIDTH))
    assert err is None
    assert_bit_identical(stock, cached)
    assert mc.stats()["invalid"] >= 1


def test_corrupted_entry_content_is_caught_by_verify_mode():
    """verify=True compares each served mask with a fresh build; a tampered row is dropped and stock runs."""
    mc.configure(verify=True)
    pair = Lockstep(index())
    ids = torch.zeros(1, 1, dtype=torch.long)
    pair.step(ids, torch.zeros(1, WIDTH))
    cache = mc.runtime.RUNTIME.cache
    for value, _ in cache._entries.values():
        value.fill_(float("inf"))  # every token "allowed": the worst corruption
    pair.reset()
    stock, cached, err = pair.step(ids, torch.randn(1, WIDTH))
    assert_bit_identical(stock, cached)
    stats = mc.stats()
    assert stats["invalid"] >= 1 and stats["fallbacks"] >= 1


def test_numpy_rows_are_read_only():
    from outlines_maskcache.kernels.numpy import KERNEL

    row = KERNEL.row(np.array([True, False]), "bound", np.zeros((1, 2), np.float32))
    with pytest.raises(ValueError):
        row[0] = 0.0
    few_blocked = KERNEL.row(np.array([True] * 7 + [False]), "bound", np.zeros((1, 8), np.float32))
    with pytest.raises(ValueError):
        few_blocked.ids[0] = 3


def test_numpy_rows_of_every_kind_compare_by_mask_and_check_their_width():
    """verify=True compares a served row with a fresh one that may be of another kind (settings changed)."""
    from outlines_maskcache.kernels import BlockedIds
    from outlines_maskcache.kernels.numpy import KERNEL

    from support.drivers import numpy_blocked_below

    logits = np.zeros((1, 8), np.float32)
    allowed = np.array([True] * 6 + [False, False])
    other = allowed.copy()
    other[0] = False
    with numpy_blocked_below(0.25):
        blocked = KERNEL.row(allowed, "bound", logits)
        blocked_other = KERNEL.row(other, "bound", logits)
    with numpy_blocked_below(0.0):
        dense = KERNEL.row(allowed, "bound", logits)
        ids = KERNEL.row(allowed, "bound", logits, sparse_below=1.0)
    assert type(blocked) is BlockedIds and type(dense) is np.ndarray and ids.dtype == np.int64
    for a in (blocked, dense, ids):
        for b in (blocked, dense, ids):
            assert KERNEL.equal(a, b)
        assert not KERNEL.equal(a, blocked_other) and not KERNEL.equal(blocked_other, a)
    assert KERNEL.valid(blocked, "bound", logits)
    assert not KERNEL.valid(blocked, "bound", np.zeros((1, 9), np.float32))
    assert not KERNEL.valid(BlockedIds(blocked.ids.astype(np.int32), 8), "bound", logits)


# -- threads --------------------------------------------------------------------
def test_many_threads_same_and_different_grammars_with_constant_eviction():
    patterns = [r"(ab|ba)+[01]{0,3}", r'"[ab01]{0,6}"', r"a*b*[01]{1,3}", r"(a|b)(0|1)(a|ab)*"]
    indexes = [index(p) for p in patterns]
    mc.configure(max_bytes=3 * WIDTH * 4)  # three rows per device: evicts nearly every step
    n_threads, steps = 8, 40 if not nightly() else 400
    errors: list[BaseException] = []
    done = []

    def worker(k: int) -> None:
        try:
            rng = np.random.default_rng(k)
            for round_ in range(3):
                walk(indexes[(k + round_) % len(indexes) if k % 2 else 0], EOS, rng, batch=int(rng.integers(1, 5)),
                     steps=steps, width=WIDTH, dtype=[torch.float32, torch.bfloat16][k % 2])
            done.append(k)
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(n_threads)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(not t.is_alive() for t in threads), "deadlock or livelock"
    assert not errors, errors[0]
    stats = mc.stats()
    assert stats["evictions"] > 0 and stats["fallbacks"] == 0
    assert all(b <= 3 * WIDTH * 4 for b in stats["bytes_by_device"].values())
    cache = mc.runtime.RUNTIME.cache
    assert stats["bytes"] == sum(v.element_size() * v.numel() for v, _ in cache._entries.values())
    report("threads", {"threads": n_threads, "steps_per_thread": 3 * steps, "evictions": stats["evictions"],
                       "hits": stats["hits"], "misses": stats["misses"], "seconds": round(time.monotonic() - started, 2),
                       "mismatches": 0})


# -- processes ------------------------------------------------------------------
_PARENT_INDEX: list = []


def _child_walk(queue) -> None:
    try:
        import outlines_maskcache as child_mc

        # A forked child sees the parent's Index object (and its cached rows);
        # a spawned one starts empty and builds its own.
        walk(_PARENT_INDEX[0] if _PARENT_INDEX else index(), EOS, np.random.default_rng(9), batch=3, steps=10, width=WIDTH)
        queue.put(("ok", child_mc.is_installed(), child_mc.stats()["hits"]))
    except BaseException as err:  # noqa: BLE001
        queue.put(("error", repr(err), 0))


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_child_processes_inherit_or_install_and_stay_correct(method):
    if method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"{method} unavailable on this platform")
    _PARENT_INDEX[:] = [index()]
    walk(_PARENT_INDEX[0], EOS, np.random.default_rng(9), batch=3, steps=10, width=WIDTH)  # parent cache is warm
    ctx = multiprocessing.get_context(method)
    queue = ctx.Queue()
    child = ctx.Process(target=_child_walk, args=(queue,))
    child.start()
    status, installed, hits = queue.get(timeout=240)
    child.join(timeout=60)
    assert status == "ok", installed
    assert installed is True and child.exitcode == 0
    if method == "fork":
        assert hits > 0  # inherited CPU rows are reused
    # the parent is unaffected
    walk(_PARENT_INDEX.pop(), EOS, np.random.default_rng(9), batch=3, steps=5, width=WIDTH)


def test_fork_drops_accelerator_entries():
    cache = mc.runtime.RUNTIME.cache
    cache.get_or_build(("g", "cuda:0", 1), lambda: b"x", len)
    cache.get_or_build(("g", "cpu", 1), lambda: b"y", len)
    mc.runtime.RUNTIME._after_fork()
    assert cache.get(("g", "cuda:0", 1)) is None and cache.get(("g", "cpu", 1)) == b"y"


# -- memory ---------------------------------------------------------------------
def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def test_soak_many_distinct_grammars_stays_within_budget():
    from outlines.backends.outlines_core import OutlinesCoreLogitsProcessor
    from outlines_core import Index, Vocabulary

    budget = 64 * WIDTH * 4
    mc.configure(max_bytes=budget, max_grammars=16)
    vocabulary = Vocabulary(EOS, VOCAB)
    seconds = 120 if nightly() else 8
    deadline = time.monotonic() + seconds
    rng = np.random.default_rng(0)
    rss_start, peak_bytes, grammars = _rss_mb(), 0, 0
    cache = mc.runtime.RUNTIME.cache
    while time.monotonic() < deadline:
        literal = "".join(rng.choice(["a", "b", "0", "1"], size=int(rng.integers(3, 9))))
        pattern = f"{literal}(ab|ba){{0,{int(rng.integers(1, 4))}}}"
        idx = Index(pattern, vocabulary)
        processor = OutlinesCoreLogitsProcessor(idx, "torch")
        ids = torch.zeros(2, 1, dtype=torch.long)
        for _ in range(6):
            out = processor(ids, torch.randn(2, WIDTH))
            nxt = [int(np.flatnonzero(row.numpy() != -np.inf)[0]) for row in out]
            ids = torch.cat([ids, torch.tensor(nxt)[:, None]], dim=1)
        grammars += 1
        stats = mc.stats()
        real = sum(v.element_size() * v.numel() for v, _ in cache._entries.values())
        assert stats["bytes"] == real <= budget
        peak_bytes = max(peak_bytes, real)
    growth = _rss_mb() - rss_start
    registry = mc.runtime.RUNTIME.grammars
    assert len(registry._by_id) <= 4 * 16, "grammar registry must stay bounded"
    assert growth < 200, f"RSS grew {growth:.0f} MB"
    report("soak", {"seconds": seconds, "grammars": grammars, "budget_bytes": budget, "peak_bytes": peak_bytes,
                    "rss_growth_mb": round(growth, 1), "evictions": mc.stats()["evictions"]})


def test_verify_mode_accepts_rows_of_either_kind_for_one_state():
    """Rows cached as dense, then checked against fresh sparse builds (and back): the same
    masks, so verify finds nothing wrong and stock is never needed."""
    mc.configure(verify=True, sparse_below=0.0)
    shared = index()
    walk(shared, EOS, np.random.default_rng(6), batch=3, steps=6, width=WIDTH)
    mc.configure(sparse_below=1.0)
    walk(shared, EOS, np.random.default_rng(6), batch=3, steps=6, width=WIDTH)
    stats = mc.stats()
    assert stats["verified"] > 0 and stats["fallbacks"] == 0 and stats["invalid"] == 0


def test_numpy_sparse_put_back_that_cannot_write_raises_logits_lost():
    from outlines_maskcache.kernels import LogitsLost
    from outlines_maskcache.kernels.numpy import _put_back

    view = np.full(4, -np.inf, dtype=np.float32)
    view.setflags(write=False)  # both write routes fail
    with pytest.raises(LogitsLost):
        _put_back(view, np.array([1, 3]), np.array([0.5, 2.0], dtype=np.float32))
