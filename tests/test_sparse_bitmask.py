"""The sparse-row bitmask apply equals the packed-bitmask kernel's semantics bit for bit.

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

from outlines_maskcache.sparse_bitmask import SparseBitmaskApplier

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
    n_rows = draw(st.integers(1, 6))
    vocab = draw(st.integers(min_vocab, 700))
    words = (vocab + 31) // 32 + draw(st.integers(0, 1))  # bitmask may be wider than the vocabulary
    width = vocab + draw(st.integers(0, 40))  # logits may be wider than the vocabulary
    shares = draw(st.lists(st.sampled_from([0.0, 0.002, 0.02, 0.1, 0.5, 0.97, 1.0]), min_size=1, max_size=4))
    bitmask = _bitmask(rng, max(n_rows, draw(st.integers(1, 6))), words, shares)
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


def _applied(applier: SparseBitmaskApplier, logits, bitmask, rows, vocab_size) -> tuple[torch.Tensor, tuple[int, int]]:
    out = logits.clone()

    def rest(found: list[int] | None) -> None:
        reference(out, bitmask, rows if found is None else found, vocab_size)

    return out, applier.apply(out, bitmask, rows, vocab_size, rest)


@settings(deadline=None)
@given(cases())
def test_equals_reference_bit_for_bit(case):
    logits, bitmask, rows, vocab_size = case
    applier = SparseBitmaskApplier()
    assert applier.applies_to(logits, bitmask)
    expected = logits.clone()
    reference(expected, bitmask, rows, vocab_size)
    for _ in range(2):  # the second pass serves every plan from the LRU
        got, _ = _applied(applier, logits, bitmask, rows, vocab_size)
        assert torch.equal(got.view(torch.int16 if got.element_size() == 2 else torch.int32),
                           expected.view(torch.int16 if expected.element_size() == 2 else torch.int32))


def test_sparse_rows_are_planned_and_dense_rows_passed_on():
    rng = np.random.default_rng(0)
    bitmask = _bitmask(rng, 4, 4008, [0.1, 0.97, 0.0, 1.0])  # 128,256 tokens
    logits = torch.randn(4, 128_256)
    applier = SparseBitmaskApplier()
    passed: list[list[int]] = []
    counts = applier.apply(logits.clone(), bitmask, None, None, passed.append)
    assert counts == (2, 2) and passed == [[1, 3]]
    assert applier.plans_made == 2 and len(applier) == 2
    applier.apply(logits.clone(), bitmask, [2, 0], None, passed.append)
    assert applier.plans_made == 2  # same bits, same plans, whatever the row order


def test_lru_is_bounded_by_bytes():
    applier = SparseBitmaskApplier(max_bytes=3 * (64 * 4 + 8 * 8))
    for seed in range(10):
        bitmask = _bitmask(np.random.default_rng(seed), 1, 64, [0.003])
        assert applier.apply(torch.randn(1, 64 * 32), bitmask, None, None, lambda rows: None) == (1, 0)
        assert applier._bytes <= applier.max_bytes
    assert applier.plans_made == 10 and 0 < len(applier) <= 3


def test_tensors_it_does_not_take():
    applier = SparseBitmaskApplier()
    bits = torch.zeros(2, 4, dtype=torch.int32)
    assert not applier.applies_to(torch.zeros(2, 128, dtype=torch.float64), bits)
    assert not applier.applies_to(torch.zeros(128), bits)
    assert not applier.applies_to(torch.zeros(2, 128), bits.to(torch.int64))
    assert not applier.applies_to(torch.zeros(2, 128), bits.t().contiguous().t())


def test_out_of_range_rows_go_to_the_kernel():
    applier = SparseBitmaskApplier()
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
    got, _ = _applied(SparseBitmaskApplier(), logits, bitmask, rows, None)
    width = torch.int16 if got.element_size() == 2 else torch.int32
    assert torch.equal(got.view(width), expected.view(width))


def test_counts_without_numpy_bitwise_count(monkeypatch):
    """numpy < 2 has no bitwise_count: the unpacking fallback counts the same."""
    from outlines_maskcache import sparse_bitmask

    bits = _bitmask(np.random.default_rng(3), 3, 40, [0.01, 0.5, 1.0]).numpy()
    expected = sparse_bitmask._set_bits(bits).tolist()
    assert expected == [int(np.unpackbits(row.view(np.uint8)).sum()) for row in bits]
    if hasattr(np, "bitwise_count"):
        monkeypatch.delattr(np, "bitwise_count")
    assert sparse_bitmask._set_bits(bits).tolist() == expected
    assert sparse_bitmask._set_bits(bits[:, ::7]).tolist() == [int(np.unpackbits(np.ascontiguousarray(r).view(np.uint8)).sum())
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
        SparseBitmaskApplier().apply(got, bitmask, None, None, lambda rows: None)
    rows_done = [r for r in range(3) if torch.isinf(got[r]).any()]
    for r in rows_done:  # every filled row got its allowed values back by the second route
        assert torch.equal(got[r], expected[r])
    monkeypatch.setattr(torch.Tensor, "__setitem__", broken)
    with pytest.raises(LogitsLost):
        SparseBitmaskApplier().apply(logits.clone(), bitmask, None, None, lambda rows: None)
