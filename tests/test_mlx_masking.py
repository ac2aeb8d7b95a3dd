"""mlx-lm path: cached MLX masking equals stock outlines' numpy masking bit for bit.

Stock's MLX kernel is a Metal kernel and cannot run off Apple hardware, so
the reference here is stock's numpy processor over the same Index and
logits; both implement "allowed: unchanged, blocked: -inf".
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import outlines_maskcache as mc
from support.drivers import assert_bit_identical, random_logits
from support.strategies import regexes, vocabularies
from support.versions import requires_outlines_core_backend

mx = pytest.importorskip("mlx.core", reason="mlx (pip install 'mlx[cpu]') is not installed")
pytestmark = requires_outlines_core_backend


@given(regex=regexes(), vocab=vocabularies(), seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 6),
       extra=st.integers(0, 20), nan=st.booleans())
def test_mlx_cached_equals_numpy_stock(regex, vocab, seed, batch, extra, nan):
    from outlines.backends.outlines_core import OutlinesCoreLogitsProcessor
    from outlines_core import Index, Vocabulary

    tokens, eos, n_ids = vocab
    try:
        index = Index(regex, Vocabulary(eos, tokens))
    except (ValueError, RuntimeError):
        assume(False)
    stock = OutlinesCoreLogitsProcessor(index, "numpy")
    cached = OutlinesCoreLogitsProcessor(index, "mlx")
    rng = np.random.default_rng(seed)
    width = n_ids + extra
    ids = rng.integers(0, width, size=(batch, 1))
    for step in range(10):
        logits = random_logits(rng, batch, width, None, "numpy", specials=True, nan=nan)
        try:
            with mc.disabled():
                expected = stock(ids.copy(), logits.copy())
        except ValueError as err:  # outlines_core#227 at a final state: stock raises, so must we
            with pytest.raises(type(err)):
                cached(mx.array(ids), mx.array(logits))
            return
        got = np.array(cached(mx.array(ids), mx.array(logits)))
        assert_bit_identical(expected, got, f"step {step}")
        nxt = []
        for r in range(batch):
            allowed = np.flatnonzero(expected[r] != -np.inf)
            nxt.append(int(rng.choice(allowed)) if allowed.size else eos)
        ids = np.concatenate([ids, np.asarray(nxt)[:, None]], axis=1)
    assert mc.stats()["fallbacks"] == 0
