"""The planned bitmask apply (sparse rows planned, the rest to the kernel) equals the packed-bitmask kernel's semantics bit for bit.

The reference is the documented operation (every listed row, every token
below ``vocab_size`` whose bit is 0 becomes ``-inf``, nothing else changes),
written in the plainest torch; where xgrammar is installed its CPU kernel is
compared too, since that is what the vLLM target stands in for.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from outlines_maskcache.kernels.bitmask_plans import Applied, BitmaskApplier

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None, vocab_size: int | None) -> None:
    n = min(logits.shape[1], bitmask.shape[1] * 32) if vocab_size is None else vocab_size
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :n].astype(bool)
    for r in (range(logits.shape[0]) if rows is None else rows):
        logits[r, :n].masked_fill_(~torch.from_numpy(bits[r]), float("-inf"))


def _bitmask(rng: np.random.Generator, n_rows: int, words: int, shares: list[float]) -> torch.Tensor:
    allowed = np.stack([rng.random(words * 32) < shares[i % len(shares)] for i in range(n_rows)])
    return torch.from_numpy(np.packbits(allowed, axis=1, bitorder="little").view(np.int32).copy())


@st.composite
def cases(draw, min_vocab: int = 1):
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    n_rows = draw(st.integers(1, 10))
    vocab = draw(st.integers(min_vocab, 700))
    words = (vocab + 31) // 32 + draw(st.integers(0, 1))  # bitmask may be wider than the vocabulary
    width = vocab + draw(st.integers(0, 40))  # logits may be wider than the vocabulary
    shares = draw(st.lists(st.sampled_from([0.0, 0.002, 0.02, 0.1, 0.5, 0.97, 1.0]), min_size=1, max_size=4))
    bitmask = _bitmask(rng, max(n_rows, draw(st.integers(1, 10))), words, shares)
    for r in draw(st.lists(st.integers(1, bitmask.shape[0] - 1), max_size=8)) if bitmask.shape[0] > 1 else ():
        # near copies of row 0 (another JSON field's string): equal rows share one plan, near ones do not
        near = bitmask[0].numpy().copy()
        for _ in range(draw(st.integers(0, 3))):
            near.view(np.uint32)[draw(st.integers(0, words - 1))] ^= np.uint32(1 << draw(st.integers(0, 31)))
        bitmask[r] = torch.from_numpy(near)
    logits = torch.from_numpy(rng.standard_normal((n_rows, width)).astype(np.float32) * 4)
    if draw(st.booleans()):
        logits[torch.from_numpy(rng.random(logits.shape) < 0.05)] = float("nan")
    if draw(st.booleans()):
        logits[torch.from_numpy(rng.random(logits.shape) < 0.05)] = -0.0
    logits = logits.to(draw(st.sampled_from(DTYPES)))
    mode = draw(st.sampled_from(["all", "subset", "vocab_size"]))
    rows = None
    vocab_size = None
    if mode == "subset" or bitmask.shape[0] != n_rows:
        rows = draw(st.lists(st.integers(0, n_rows - 1), min_size=1, max_size=n_rows, unique=True))
    if mode == "vocab_size":
        vocab_size = draw(st.integers(1, min(width, bitmask.shape[1] * 32)))
    return logits, bitmask, rows, vocab_size


def _like(logits: torch.Tensor) -> torch.Tensor:
    """A copy in the same layout (``clone`` makes padded rows contiguous); padding holds 7.0."""
    if logits.stride(1) == 1 and logits.stride(0) > logits.shape[1]:
        out = torch.full((logits.shape[0], logits.stride(0)), 7.0, dtype=logits.dtype)[:, : logits.shape[1]]
    elif logits.is_contiguous():
        return logits.clone()
    else:
        out = logits.t().clone().t()
    return out.copy_(logits)


def _applied(applier: BitmaskApplier, logits, bitmask, rows, vocab_size, **hints) -> tuple[torch.Tensor, Applied]:
    out = _like(logits)

    def rest(found: list[int] | None) -> None:
        reference(out, bitmask, rows if found is None else found, vocab_size)

    return out, applier.apply(out, bitmask, rows, vocab_size, rest, **hints)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    width = torch.int16 if a.element_size() == 2 else torch.int32
    return a.dtype == b.dtype and torch.equal(a.view(width), b.view(width))


@st.composite
def hints(draw, bitmask: torch.Tensor):
    """Rows a filler would say it served: copies of bitmask rows, and decoys one word away from one."""
    bits = bitmask.numpy()
    expected = []
    every = st.just(list(range(bits.shape[0])))  # the usual case: the filler served every row
    for r in draw(st.one_of(every, st.lists(st.integers(0, bits.shape[0] - 1), max_size=4))):
        row = bits[r].copy()
        if draw(st.booleans()):  # a decoy: equal but for one word, sampled or not
            word = draw(st.integers(0, row.shape[0] - 1))
            row.view(np.uint32)[word] ^= np.uint32(1 << draw(st.integers(0, 31)))
        row.flags.writeable = False
        expected.append(row)
    return dict(expected=expected, by_content=draw(st.booleans()))


@settings(deadline=None)
@given(cases(), st.data())
def test_equals_reference_bit_for_bit(case, data):
    logits, bitmask, rows, vocab_size = case
    layout = data.draw(st.sampled_from(["contiguous", "padded rows", "column-major"]), label="logits layout")
    if layout == "padded rows":  # vLLM's CPU logits: rows of a wider buffer
        logits = torch.cat([logits, torch.full((logits.shape[0], 3), 7.0, dtype=logits.dtype)], dim=1)[:, : logits.shape[1]]
    elif layout == "column-major":
        logits = logits.t().contiguous().t()
    extra = data.draw(hints(bitmask), label="hints")
    applier = BitmaskApplier()
    assert applier.applies_to(logits, bitmask)
    expected = logits.clone()
    reference(expected, bitmask, rows, vocab_size)
    for _ in range(2):  # the second pass serves every plan from the LRU
        got, counts = _applied(applier, logits, bitmask, rows, vocab_size, **extra)
        assert _same(got, expected)
        if layout == "padded rows":  # the padding past each row is never written
            padding = got.as_strided((got.shape[0], 3), (got.stride(0), 1), got.storage_offset() + got.shape[1])
            assert bool((padding == 7.0).all())
        assert sum(counts) == len(range(logits.shape[0]) if rows is None else rows)


def test_sparse_rows_are_planned_from_hints_without_hashing(monkeypatch):
    rng = np.random.default_rng(2)
    bitmask = _bitmask(rng, 3, 64, [0.01])
    served = [bitmask[k].numpy().copy() for k in range(3)]
    logits = torch.randn(3, 64 * 32)
    expected = logits.clone()
    reference(expected, bitmask, None, None)
    applier = BitmaskApplier()
    monkeypatch.setattr(applier, "_content_plan", None)  # would raise if a row were looked up by its bytes
    got, counts = _applied(applier, logits, bitmask, None, None, expected=served, by_content=False)
    assert _same(got, expected) and counts == Applied(3, 0)


def test_failed_fill_leaves_the_kernel_a_whole_call(monkeypatch):
    """A sparse fill that fails once written: the row's allowed values are put back, the kernel's rows untouched."""
    rng = np.random.default_rng(3)
    bitmask = _bitmask(rng, 4, 64, [0.97, 0.97, 0.01, 0.5])
    served = [bitmask[k].numpy().copy() for k in range(4)]
    logits = torch.randn(4, 64 * 32)
    expected = logits.clone()
    reference(expected, bitmask, None, None)
    real = torch.Tensor.fill_

    def broken(self, value):
        real(self, value)
        raise RuntimeError("fill failed")

    monkeypatch.setattr(torch.Tensor, "fill_", broken)
    got = logits.clone()
    kernel_calls = []
    with pytest.raises(RuntimeError, match="fill failed"):
        BitmaskApplier().apply(got, bitmask, None, None, kernel_calls.append, expected=served)
    assert kernel_calls == []  # the kernel runs last, after every write that could fail
    for r in (0, 1, 3):  # the kernel's rows: as they were
        assert _same(got[r], logits[r])
    allowed = torch.from_numpy(np.unpackbits(bitmask[2].numpy().view(np.uint8), bitorder="little").astype(bool))
    assert _same(got[2][allowed], logits[2][allowed])  # the sparse row: its allowed values put back
    reference(got, bitmask, None, None)  # what the caller's fallback does: the kernel over the whole call
    assert _same(got, expected)


def test_sparse_rows_are_planned_and_the_others_passed_on():
    rng = np.random.default_rng(0)
    bitmask = _bitmask(rng, 4, 4008, [0.1, 0.97, 0.0, 1.0])  # 128,256 tokens
    logits = torch.randn(4, 128_256)
    applier = BitmaskApplier()
    passed: list[list[int]] = []
    counts = applier.apply(logits.clone(), bitmask, None, None, passed.append)
    assert counts == Applied(sparse=2, kernel=2) and passed == [[1, 3]]
    assert applier.plans_made == 2 and len(applier) == 2
    applier.apply(logits.clone(), bitmask, [2, 0], None, passed.append)
    assert applier.plans_made == 2  # same bits, same plans, whatever the row order


def test_lru_is_bounded_by_bytes():
    applier = BitmaskApplier(max_bytes=3 * (64 * 4 + 8 * 8))
    for seed in range(10):
        bitmask = _bitmask(np.random.default_rng(seed), 1, 64, [0.003])
        assert applier.apply(torch.randn(1, 64 * 32), bitmask, None, None, lambda rows: None) == (1, 0)
        assert applier._bytes <= applier.max_bytes
    assert applier.plans_made == 10 and 0 < len(applier) <= 3


def test_tensors_it_does_not_take():
    applier = BitmaskApplier()
    bits = torch.zeros(2, 4, dtype=torch.int32)
    assert not applier.applies_to(torch.zeros(2, 128, dtype=torch.float64), bits)
    assert not applier.applies_to(torch.zeros(128), bits)
    assert not applier.applies_to(torch.zeros(2, 128), bits.to(torch.int64))
    assert not applier.applies_to(torch.zeros(2, 128), bits.t().contiguous().t())


def test_out_of_range_rows_go_to_the_kernel():
    applier = BitmaskApplier()
    passed: list[list[int]] = []
    assert applier.apply(torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32), [0, 5], None, passed.append) == (0, 2)
    assert applier.apply(torch.zeros(2, 64), torch.zeros(3, 2, dtype=torch.int32), None, None, passed.append) == (0, 2)
    assert passed == [None, None]  # the kernel gets the call as it was made


xgrammar = pytest.importorskip("xgrammar", reason="xgrammar (the kernel vLLM uses) is not installed here")


@pytest.mark.filterwarnings("ignore:The bitmask covers only")  # xgrammar >= 0.1.30 on logits wider than the bitmask
@settings(deadline=None, max_examples=60)
@given(cases(min_vocab=64))
def test_equals_xgrammar_cpu_kernel(case):
    # Without vocab_size only: xgrammar's CPU kernel masks whole 32-bit words
    # past a vocab_size that is not a multiple of 32, so the vLLM stand-in
    # hands every call with vocab_size to xgrammar (vLLM passes none).
    # Vocabularies of 64 tokens or more: on one- or two-word rows xgrammar
    # 0.2.8/0.2.9's CPU kernel masks allowed tokens and can corrupt memory
    # (found by this test), a shape no vLLM model has.  And only where the
    # kernel's vocab_size (min of the logits' width and the bitmask's bits)
    # is whole words: past a partial last word the kernel can write beyond
    # the logits (found by this test with a guarded buffer: e.g. 6 rows of
    # 168 logits, 6 words, float32; 1 call in ~3,000 random ones), which
    # corrupted the heap and aborted the whole pytest process in CI.
    logits, bitmask, rows, _ = case
    assume(min(logits.shape[1], bitmask.shape[1] * 32) % 32 == 0)
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask, indices=rows)
    served = [bitmask[r].numpy().copy() for r in range(bitmask.shape[0])]
    for hinted in ({}, dict(expected=served)):  # with the fill's hint, and by content
        got, _ = _applied(BitmaskApplier(), logits, bitmask, rows, None, **hinted)
        assert _same(got, expected)


def test_counts_without_numpy_bitwise_count(monkeypatch):
    """numpy < 2 has no bitwise_count: the unpacking fallback counts the same."""
    from outlines_maskcache.kernels import bitmask_plans

    bits = _bitmask(np.random.default_rng(3), 3, 40, [0.01, 0.5, 1.0]).numpy()
    expected = bitmask_plans._set_bits(bits).tolist()
    assert expected == [int(np.unpackbits(row.view(np.uint8)).sum()) for row in bits]
    if hasattr(np, "bitwise_count"):
        monkeypatch.delattr(np, "bitwise_count")
    assert bitmask_plans._set_bits(bits).tolist() == expected
    assert bitmask_plans._set_bits(bits[:, ::7]).tolist() == [int(np.unpackbits(np.ascontiguousarray(r).view(np.uint8)).sum())
                                                               for r in bits[:, ::7]]


def test_failed_put_back_restores_allowed_values_or_raises_logits_lost(monkeypatch):
    """Between a row's fill and its put-back its allowed values live only in the plan: never lost silently."""
    from outlines_maskcache.kernels import LogitsLost

    bitmask = _bitmask(np.random.default_rng(5), 3, 64, [0.01])
    bitmask[1] = bitmask[0]  # rows 0 and 1 share a plan: the grouped path
    logits = torch.randn(3, 64 * 32)
    expected = logits.clone()
    reference(expected, bitmask, None, None)

    def broken(*args, **kwargs):
        raise RuntimeError("put-back failed")

    monkeypatch.setattr(torch.Tensor, "index_put_", broken)
    got = logits.clone()
    with pytest.raises(RuntimeError, match="put-back failed"):
        BitmaskApplier().apply(got, bitmask, None, None, lambda rows: None)
    rows_done = [r for r in range(3) if torch.isinf(got[r]).any()]
    for r in rows_done:  # every filled row got its allowed values back by the second route
        assert torch.equal(got[r], expected[r])
    monkeypatch.setattr(torch.Tensor, "index_copy_", broken)
    with pytest.raises(LogitsLost):
        BitmaskApplier().apply(logits.clone(), bitmask, None, None, lambda rows: None)


def test_a_hinted_row_written_after_its_plan_gets_a_new_plan():
    """Plans are kept per row object but serve only the words they were made from."""
    rng = np.random.default_rng(7)
    bitmask = _bitmask(rng, 4, 64, [0.01])
    bitmask[1:] = bitmask[0]
    served = bitmask[0].numpy().copy()  # writeable: a careless caller
    applier = BitmaskApplier()
    logits = torch.randn(4, 64 * 32)
    for flip in (None, 3, 40):
        if flip is not None:
            served[flip] ^= 1 << 5
            bitmask[:] = torch.from_numpy(served)
        expected = logits.clone()
        reference(expected, bitmask, None, None)
        got, counts = _applied(applier, logits, bitmask, None, None, expected=[served], by_content=False)
        assert _same(got, expected) and counts == Applied(4, 0)
