"""Cached masks equal stock outlines' bit for bit (outlines 1.2+ processor).

Random regexes over random vocabularies, and real tokenizers with real
schemas; batches whose rows sit in different states, resets, EOS/final
states, logits wider than the vocabulary, fp32/fp16/bf16, torch and numpy.
Without torch (the Python 3.10/3.13 sessions) the same walks drive the
numpy processor only.
"""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import outlines_maskcache as mc
from support.drivers import Lockstep, assert_bit_identical, numpy_blocked_below, random_logits, torch, walk
from support.material import gpt2_tokenizer, llama3_tokenizer
from support.strategies import regexes, vocabularies
from support.versions import requires_outlines_core_backend

pytestmark = requires_outlines_core_backend

DTYPES = [torch.float32, torch.float16, torch.bfloat16] if torch is not None else [None]
LIBRARIES = ["torch", "numpy"] if torch is not None else ["numpy"]
requires_torch = pytest.mark.skipif(torch is None, reason="torch is not installed (torch-free session)")


def compile_index(regex: str, vocab: dict, eos: int):
    from outlines_core import Index, Vocabulary

    try:
        return Index(regex, Vocabulary(eos, vocab))
    except (ValueError, RuntimeError):
        return None


@given(regex=regexes(), vocab=vocabularies(), seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 8),
       extra=st.integers(0, 40), dtype=st.sampled_from(DTYPES), library=st.sampled_from(LIBRARIES),
       resets=st.integers(0, 2), sparse=st.sampled_from([0.0, 0.3, 1.0]), blocked=st.sampled_from([0.0, 0.25, 1.0]))
def test_random_regex_random_vocab(regex, vocab, seed, batch, extra, dtype, library, resets, sparse, blocked):
    with numpy_blocked_below(blocked):
        _random_walks(regex, vocab, seed, batch, extra, dtype, library, resets, sparse)


def _random_walks(regex, vocab, seed, batch, extra, dtype, library, resets, sparse):
    tokens, eos, n_ids = vocab
    # 0: every state a dense row; 1: every state its allowed ids; 0.3: a mix within one batch.
    # numpy also keeps states blocking few tokens as their blocked ids (``blocked``).
    mc.configure(sparse_below=sparse)
    index = compile_index(regex, tokens, eos)
    assume(index is not None)
    if library == "numpy":
        # llama.cpp logits are float32; stock's numba kernel rejects float16.
        dtype = None
    rng = np.random.default_rng(seed)
    pair = None
    for generation in range(resets + 1):
        if pair is not None:
            pair.reset()
        pair = walk(index, eos, rng, batch=batch if generation == 0 else int(rng.integers(1, 9)), steps=12,
                    width=n_ids + extra, dtype=dtype, library=library, lockstep=pair)
    assert mc.stats()["fallbacks"] == 0


@given(regex=regexes(), vocab=vocabularies(), seed=st.integers(0, 2**32 - 1), form=st.sampled_from(["bound", "blocked"]),
       sparse=st.sampled_from([0.0, 0.3, 1.0]), library=st.sampled_from(LIBRARIES),
       blocked=st.sampled_from([0.0, 0.25, 1.0]))
def test_nan_logits_with_guard(regex, vocab, seed, form, sparse, library, blocked):
    """NaN logits: exact with nan_guard (bound form) and always with the blocked form, sparse and blocked-id rows."""
    tokens, eos, n_ids = vocab
    index = compile_index(regex, tokens, eos)
    assume(index is not None)
    mc.configure(nan_guard=True, form=form, sparse_below=sparse)
    with numpy_blocked_below(blocked):
        walk(index, eos, np.random.default_rng(seed), batch=4, steps=8, width=n_ids + 3, nan=True, library=library)


@given(regex=regexes(), vocab=vocabularies(), seed=st.integers(0, 2**32 - 1), extra=st.integers(0, 40),
       sparse=st.sampled_from([0.0, 0.3]), blocked=st.sampled_from([0.0, 0.25, 1.0]), nan=st.booleans())
def test_llamacpp_shaped_calls(regex, vocab, seed, extra, sparse, blocked, nan):
    """llama.cpp's call: 1-D token ids and a strided float32 view of its candidate records.

    The cached processor takes a shortcut around stock's tensor-adapter
    normalisation for this shape; the result, and what is left in the
    caller's view (llama-cpp-python copies the return value back into it),
    must equal stock's.
    """
    from outlines.backends.outlines_core import OutlinesCoreLogitsProcessor

    tokens, eos, n_ids = vocab
    index = compile_index(regex, tokens, eos)
    assume(index is not None)
    mc.configure(nan_guard=nan, sparse_below=sparse)
    width = n_ids + extra
    record = np.dtype([("id", np.intc), ("logit", np.single), ("p", np.single)], align=True)
    stock_p, cached_p = (OutlinesCoreLogitsProcessor(index, "numpy") for _ in range(2))
    rng = np.random.default_rng(seed)
    ids = list(rng.integers(0, width, size=3))
    with numpy_blocked_below(blocked):
        for step in range(10):
            logits = random_logits(rng, 1, width, None, "numpy", specials=True, nan=nan)[0]
            views = []
            for processor in (stock_p, cached_p):
                candidates = np.recarray((width,), dtype=record)
                candidates.logit[:] = logits
                with mc.disabled() if processor is stock_p else contextlib.nullcontext():
                    out = processor(np.asarray(ids, dtype=np.intc), candidates.logit)
                assert out.shape == (width,)
                candidates.logit[:] = out
                views.append((out, candidates.logit))
            (stock_out, stock_view), (cached_out, cached_view) = views
            assert_bit_identical(stock_out, cached_out, f"step {step}")
            assert_bit_identical(stock_view, cached_view, f"step {step}, candidates")
            allowed = np.flatnonzero(stock_out != -np.inf)
            if allowed.size == 0 or (eos in allowed and step > 6):
                break
            ids.append(int(rng.choice(allowed)))
    assert mc.stats()["fallbacks"] == 0


def _real_vocabulary(tokenizer):
    from outlines.backends.outlines_core import OutlinesCoreBackend
    from outlines.models.transformers import TransformerTokenizer

    import inspect

    tok = TransformerTokenizer(tokenizer)
    args = [tokenizer.get_vocab(), tokenizer.eos_token_id, tokenizer.eos_token]
    if "token_to_str" in inspect.signature(OutlinesCoreBackend.create_outlines_core_vocabulary).parameters:
        args.append(tok.convert_token_to_string)  # 1.2.1+
    with mc.disabled():
        return OutlinesCoreBackend.create_outlines_core_vocabulary(*args), tokenizer.eos_token_id, len(tokenizer)


SCHEMAS = {
    "user": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                              "email": {"type": "string", "format": "email"}, "admin": {"type": "boolean"}},
             "required": ["name", "age"]},
    "enum_array": {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
                                                    "score": {"type": "number"}}, "required": ["tags", "score"]},
}
REGEXES = [r"\d{3}-\d{2}-\d{4}", r"(yes|no|maybe)", r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8})?", r"-?\d+(\.\d{1,3})?"]


@pytest.mark.parametrize("name", ["gpt2", "llama3"])
def test_real_tokenizer_real_schemas(name):
    from outlines_core import Index
    from outlines_core.json_schema import build_regex_from_schema

    tokenizer = {"gpt2": gpt2_tokenizer, "llama3": llama3_tokenizer}[name]()
    if tokenizer is None:
        pytest.skip(f"{name} tokenizer package not installed")
    vocabulary, eos, n = _real_vocabulary(tokenizer)
    patterns = [build_regex_from_schema(json.dumps(s)) for s in SCHEMAS.values()] + REGEXES
    rng = np.random.default_rng(0)
    for i, pattern in enumerate(patterns):
        index = Index(pattern, vocabulary)
        # Wider than the tokenizer, as checkpoints pad their output layer.
        width = n + (0 if i % 2 else 64)
        dtype = DTYPES[i % len(DTYPES)]
        pair = walk(index, eos, rng, batch=8 if i % 2 else 3, steps=10, width=width, dtype=dtype, eos_bias=0.05)
        pair.reset()
        walk(index, eos, rng, batch=2, steps=6, width=width, dtype=dtype, lockstep=pair)
    stats = mc.stats()
    assert stats["hits"] > 0 and stats["fallbacks"] == 0


@requires_torch
def test_finished_rows_keep_final_state_masks():
    """After EOS a row stays final (stock's accepts_tokens quirk) and keeps being masked like stock."""
    from outlines_core import Index, Vocabulary

    index = Index("ab", Vocabulary(9, {"a": [0], "b": [1], "ab": [2]}))
    pair = Lockstep(index)
    ids = torch.tensor([[5, 5]] * 2)
    for step, nxt in enumerate([[2, 0], [9, 1], [9, 9], [9, 9]]):
        stock, cached, err = pair.step(ids, torch.zeros(2, 12))
        assert err is None
        assert torch.equal(stock, cached), step
        ids = torch.cat([ids, torch.tensor(nxt)[:, None]], dim=1)


def test_strided_numpy_logits_like_llamacpp():
    """llama.cpp hands a float32 strided view of its candidate array (stride 12 bytes)."""
    from outlines_core import Index, Vocabulary

    index = Index("(ab|ba)+", Vocabulary(3, {"a": [0], "b": [1], "ab": [2]}))
    pair = Lockstep(index, "numpy")
    candidates = np.zeros(8, dtype=[("id", np.int32), ("logit", np.float32), ("p", np.float32)])
    candidates["logit"] = np.arange(8, dtype=np.float32)
    ids = np.array([7, 7], dtype=np.int32)
    for step in range(4):
        stock_view = candidates.copy()["logit"]
        cached_view = candidates.copy()["logit"]
        assert cached_view.strides == (12,)
        with mc.disabled():
            pair.stock(ids, stock_view)
        pair.cached(ids, cached_view)
        assert np.array_equal(stock_view.view(np.int32), cached_view.view(np.int32)), step
        allowed = np.flatnonzero(stock_view != -np.inf)
        ids = np.append(ids, allowed[0]).astype(np.int32)
