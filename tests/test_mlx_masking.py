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


# -- mlx-lm end to end ------------------------------------------------------------------------


class Recording:
    """Wraps an outlines processor as mlx-lm calls it, keeping each step's ids, logits and result."""

    def __init__(self, processor):
        self.processor = processor
        self.steps: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def __call__(self, ids, logits):
        out = self.processor(ids, logits)
        self.steps.append((np.array(ids), np.array(logits), np.array(out)))
        return out


@pytest.fixture(scope="module")
def mlxlm_model(tmp_path_factory, gpt2_hf_tokenizer):
    """A tiny random llama in mlx-lm's format, saved locally with the real GPT-2 tokenizer, loaded by mlx_lm."""
    mlx_lm = pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (the mlx session installs it)")
    import json

    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    tokenizer = gpt2_hf_tokenizer
    folder = tmp_path_factory.mktemp("mlxlm-tiny")
    tokenizer.save_pretrained(folder)
    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 128,
              "num_attention_heads": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
              "vocab_size": len(tokenizer), "tie_word_embeddings": True}
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    return mlx_lm.load(str(folder))


@pytest.mark.e2e
def test_mlxlm_generation_is_constrained_and_every_step_equals_stock(mlxlm_model):
    """``outlines.from_mlxlm`` on Linux: the cached path generates; each step equals stock's numpy processor.

    Stock's own MLX path cannot run here (its kernel is Metal-only), so each
    recorded step (the ids and logits mlx-lm passed, the logits returned) is
    replayed through stock's numpy processor over the same Index.
    """
    import re

    import outlines
    from outlines.backends.outlines_core import OutlinesCoreLogitsProcessor
    from outlines.types import Regex

    pattern = r"(ab|c[0-9]){1,3}-[a-c]{2}"
    model = outlines.from_mlxlm(*mlxlm_model)
    generator = outlines.Generator(model, Regex(pattern))
    recording = Recording(generator.logits_processor)
    text = model.generate("Hello", recording, max_tokens=24)
    assert re.fullmatch(pattern, text), text
    stats = mc.stats()
    assert stats["misses"] > 0 and stats["fallbacks"] == 0, stats
    assert len(recording.steps) >= 3

    stock = OutlinesCoreLogitsProcessor(generator.logits_processor.index, "numpy")
    with mc.disabled():
        for step, (ids, logits, got) in enumerate(recording.steps):
            expected = stock(ids.copy(), logits.copy())
            assert_bit_identical(np.asarray(expected), got.reshape(np.asarray(expected).shape), f"step {step}")


def test_stock_mlx_path_needs_metal_and_the_cached_path_does_not():
    """Off Apple hardware stock's MLX masking raises; the cached one masks (it never reaches the Metal kernel)."""
    from outlines.backends.outlines_core import OutlinesCoreLogitsProcessor
    from outlines_core import Index, Vocabulary

    if mx.metal.is_available():
        pytest.skip("Metal is available: stock's MLX path runs here")
    index = Index("ab", Vocabulary(3, {"a": [0], "b": [1], "ab": [2]}))
    logits = mx.zeros((1, 4))
    with mc.disabled(), pytest.raises(Exception, match="(?i)metal"):
        OutlinesCoreLogitsProcessor(index, "mlx")(mx.array([[3]]), logits)
    out = np.array(OutlinesCoreLogitsProcessor(index, "mlx")(mx.array([[3]]), logits))
    assert out[0].tolist() == [0.0, -np.inf, 0.0, -np.inf]
