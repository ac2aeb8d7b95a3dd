"""End to end through outlines' public API on small random-weight models with real tokenizers.

Same token ids with and without the cache, greedy and seeded sampling, single
and batch generation; and the Index memo: a repeated ``model(prompt, User)``
call compiles nothing and misses nothing on a path the first call walked.
"""

from __future__ import annotations

from typing import Literal

import pytest
import torch
from pydantic import BaseModel

import outlines_maskcache as mc
from support.material import gpt2_tokenizer, llama3_tokenizer, tiny_model
from support.versions import requires_outlines_core_backend

pytestmark = [requires_outlines_core_backend, pytest.mark.e2e]


class User(BaseModel):
    name: str
    age: int
    role: Literal["admin", "user"]


@pytest.fixture(scope="module", params=["gpt2", "llama3"])
def model(request):
    import outlines

    tokenizer = {"gpt2": gpt2_tokenizer, "llama3": llama3_tokenizer}[request.param]()
    if tokenizer is None:
        pytest.skip("tokenizer package missing")
    arch = "gpt2" if request.param == "gpt2" else "llama"
    return outlines.from_transformers(tiny_model(tokenizer, arch=arch, extra_vocab=13), tokenizer)


def _both(fn):
    with mc.disabled():
        stock = fn()
    cached = fn()
    return stock, cached


def seeded(fn, seed=1234):
    def run():
        torch.manual_seed(seed)
        return fn()
    return run


def test_pydantic_greedy_and_sampled(model):
    import outlines

    generator = outlines.Generator(model, User)
    stock, cached = _both(lambda: generator("Describe a user:", max_new_tokens=40, do_sample=False))
    assert stock == cached
    stock, cached = _both(seeded(lambda: generator("Describe a user:", max_new_tokens=40, do_sample=True, temperature=1.5)))
    assert stock == cached
    assert mc.stats()["hits"] > 0 and mc.stats()["fallbacks"] == 0


def test_regex_batch_rows_in_different_states(model):
    from outlines.types import Regex

    prompts = ["one", "two two", "three three three", "4"]
    call = seeded(lambda: model.batch(prompts, Regex(r"[a-z]{2,6}(-[0-9]{1,3})?@(ab|cd)\.(com|org)"),
                                      max_new_tokens=24, do_sample=True))
    stock, cached = _both(call)
    assert stock == cached and len(set(cached)) > 1


def test_second_call_compiles_nothing_and_misses_nothing(model):
    def call():
        return model("Describe a user:", User, max_new_tokens=30, do_sample=False)

    first = call()
    before = mc.stats()
    second = call()
    after = mc.stats()
    assert first == second
    assert after["misses"] == before["misses"], "call 2 walked the same path and must not miss"
    assert after["hits"] > before["hits"]
    assert after["grammar_memo"]["misses"] == before["grammar_memo"]["misses"]
    assert after["vocabulary_memo"]["misses"] == before["vocabulary_memo"]["misses"]
    with mc.disabled():
        assert call() == second


def test_long_generation_matches_and_parses_when_complete(model):
    import outlines

    generator = outlines.Generator(model, User)
    with mc.disabled():
        torch.manual_seed(7)
        stock = generator("Describe a user:", max_new_tokens=200, do_sample=True, temperature=0.7)
    torch.manual_seed(7)
    cached = generator("Describe a user:", max_new_tokens=200, do_sample=True, temperature=0.7)
    assert stock == cached
    assert cached.startswith("{")
    if cached.rstrip().endswith("}"):
        User.model_validate_json(cached)


def test_tokenizer_changed_in_place_is_not_served_a_stale_vocabulary():
    """Adding a token to the tokenizer must rebuild the backend's vocabulary, not reuse the memo."""
    import outlines
    from outlines.backends.outlines_core import OutlinesCoreBackend

    gpt2_tokenizer.cache_clear()  # a private tokenizer: the shared one must not change
    tok = gpt2_tokenizer()
    model = outlines.from_transformers(tiny_model(tok), tok)
    first = OutlinesCoreBackend(model)
    hits = mc.stats()["vocabulary_memo"]["hits"]
    again = OutlinesCoreBackend(model)
    assert mc.stats()["vocabulary_memo"]["hits"] == hits + 1  # memo hit...
    assert again.vocabulary is not first.vocabulary and again.vocabulary == first.vocabulary  # ...each its own copy
    tok.add_tokens(["<maskcache-test-token>"])
    second = OutlinesCoreBackend(model)
    assert mc.stats()["vocabulary_memo"]["hits"] == hits + 1 and second.vocabulary != first.vocabulary
    with mc.disabled():
        stock = OutlinesCoreBackend(model)
    new_id = tok.convert_tokens_to_ids("<maskcache-test-token>")
    assert first.vocabulary.get("<maskcache-test-token>") is None
    assert second.vocabulary.get("<maskcache-test-token>") == stock.vocabulary.get("<maskcache-test-token>") == [new_id]
    gpt2_tokenizer.cache_clear()
