"""outlines 1.2-1.3 backend: what user code can see is stock's, on whichever release is installed.

Run in every outlines-core-backend session of the version matrix (1.2.0,
1.2.3, 1.2.4, 1.3.3): the advance rule that changed in 1.2.4, the
vocabulary converter whose signature changed in 1.2.1, stock's errors,
overrides and spies, a vocabulary mutated by the user, and test doubles
put in place of outlines_core's constructors.
"""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest
import torch
from packaging.version import Version

import outlines_maskcache as mc
from support.versions import outlines_version, requires_outlines_core_backend

pytestmark = requires_outlines_core_backend

REGEXES = [r"[0-9]{1,12}", r"[a-z]+( [a-z]+){0,8}", r"[0-9]{1,3}", r"(yes|no|maybe)", r"[a-z]+@[a-z]+\.(com|org)", r"\{\"a\": [0-9]+\}"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def model(gpt2_outlines_model):
    return gpt2_outlines_model


def _width(model) -> int:
    return len(model.tokenizer.tokenizer.get_vocab())


def _converter_args(model, convert) -> list:
    """What the installed release's backend passes to create_outlines_core_vocabulary for a transformers model."""
    hf = model.tokenizer.tokenizer
    args = [hf.get_vocab(), hf.eos_token_id, hf.eos_token]
    if "token_to_str" in inspect.signature(convert).parameters:
        args.append(model.tokenizer.convert_token_to_string)
    return args


def _backend(model):
    from outlines.backends.outlines_core import OutlinesCoreBackend

    return OutlinesCoreBackend(model)


def _walk(make_processor, vocab: int, steps: int, seed: int, batch: int = 3, wider: int = 64) -> list[torch.Tensor]:
    """Masked logits of a processor walked on random allowed tokens (and EOS past the end), rows in different states."""
    gen = torch.Generator().manual_seed(seed)
    processor = make_processor()
    ids = torch.zeros((batch, 1), dtype=torch.long)
    out = []
    for _ in range(steps):
        logits = torch.randn((batch, vocab + wider), generator=gen)
        masked = processor(ids, logits.clone())
        out.append(masked.clone())
        allowed = torch.isfinite(masked)
        picks = []
        for row in allowed:
            choices = torch.nonzero(row).flatten()
            if not len(choices):  # a dead end (stock allows nothing): the walk ends here, on both sides alike
                return out
            picks.append(int(choices[torch.randint(len(choices), (1,), generator=gen)]))
        ids = torch.cat([ids, torch.tensor(picks)[:, None]], dim=1)
    return out


@pytest.mark.parametrize("regex", REGEXES + ["json"])
def test_processor_walk_equals_stock_on_this_release(model, regex):
    """Every step's logits equal stock's, past the end of the match (where the advance rule differs by release)."""
    from outlines_core.json_schema import build_regex_from_schema

    pattern = build_regex_from_schema(json.dumps(SCHEMA)) if regex == "json" else regex
    vocab = _width(model)
    for seed in range(3):
        backend = _backend(model)
        cached = _walk(lambda: backend.get_regex_logits_processor(pattern), vocab, 14, seed)
        with mc.disabled():
            # Final states that go on ([0-9]{1,12}) are where 1.2.4 changed the advance rule.
            # Before 1.3 stock's conversion keeps, of tokens that decode alike, whichever id
            # get_vocab()'s (per call random) order puts last: two stock backends differ there,
            # so stock gets this backend's vocabulary.  From 1.3 it is a backend of its own.
            stock_backend = backend if outlines_version() < Version("1.3") else _backend(model)
            stock = _walk(lambda: stock_backend.get_regex_logits_processor(pattern), vocab, 14, seed)
        for step, (a, b) in enumerate(zip(cached, stock)):
            assert torch.equal(a, b), f"step {step}, seed {seed}"
    assert mc.stats()["hits"] > 0


def test_advance_rule_is_the_installed_releases():
    from outlines_maskcache.targets.outlines.backend import ADVANCE_FINISHED_SINCE, advance_rule

    class Finished:
        def is_finished(self):
            return True

        def accepts_tokens(self, tokens):
            return True

    rule = advance_rule(outlines_version())
    assert rule(Finished(), 0) is (outlines_version() >= ADVANCE_FINISHED_SINCE)
    assert advance_rule(Version("1.2.3"))(Finished(), 0) is False
    assert advance_rule(Version("1.2.4"))(Finished(), 0) is True


def test_vocabulary_converter_takes_the_releases_arguments(model):
    """1.2.0 converts (vocab, eos_token_id, eos_token); 1.2.1+ also takes token_to_str. Both work, inside disabled() too."""
    import inspect

    from outlines.backends.outlines_core import OutlinesCoreBackend

    args = _converter_args(model, OutlinesCoreBackend.create_outlines_core_vocabulary)
    ours = OutlinesCoreBackend.create_outlines_core_vocabulary(*args)
    with mc.disabled():
        stock = OutlinesCoreBackend.create_outlines_core_vocabulary(*args)
    # Tokens that decode alike share one id list, whose order follows get_vocab()'s dict order.
    strings = {args[3](t) if len(args) > 3 else t for t in args[0]}
    assert {s: sorted(ours.get(s) or []) for s in strings} == {s: sorted(stock.get(s) or []) for s in strings}
    assert len(ours) == len(stock) and ours.get_eos_token_id() == stock.get_eos_token_id()
    with pytest.raises(TypeError):  # stock's own error for a wrong call
        OutlinesCoreBackend.create_outlines_core_vocabulary(*args, "one too many")


def test_model_generation_is_identical(model):
    import outlines

    output_type = outlines.json_schema(json.dumps(SCHEMA))
    with mc.disabled():
        stock = [model("Person:", output_type, max_new_tokens=12, do_sample=False) for _ in range(2)]
    cached = [model("Person:", output_type, max_new_tokens=12, do_sample=False) for _ in range(2)]
    assert cached == stock


def test_unsupported_model_gets_stocks_error():
    from outlines.backends.outlines_core import OutlinesCoreBackend

    with mc.disabled(), pytest.raises(Exception) as stock:
        OutlinesCoreBackend(object())
    with pytest.raises(type(stock.value)) as ours:
        OutlinesCoreBackend(object())
    assert str(ours.value) == str(stock.value)


def test_mutated_vocabulary_is_never_served_a_stale_index(model):
    """Each backend owns its vocabulary; once mutated, processors follow the mutation as stock's do."""
    first, second = _backend(model), _backend(model)
    assert first.vocabulary is not second.vocabulary
    token = "1"
    token_ids = first.vocabulary.get(token)
    assert token_ids
    first.get_regex_logits_processor(r"[0-9]{1,3}")  # memoized over the pristine vocabulary
    first.vocabulary.remove(token)
    assert second.vocabulary.get(token) == token_ids  # the other backend is untouched
    vocab = _width(model)
    logits = torch.zeros((1, vocab))
    ids = torch.zeros((1, 1), dtype=torch.long)
    ours = first.get_regex_logits_processor(r"[0-9]{1,3}")(ids, logits.clone())
    with mc.disabled():
        stock_backend = _backend(model)
        stock_backend.vocabulary.remove(token)
        stock = stock_backend.get_regex_logits_processor(r"[0-9]{1,3}")(ids, logits.clone())
    assert torch.equal(ours, stock)
    assert all(torch.isinf(ours[0, token_ids]))


def test_overridden_and_spied_bias_methods_are_called(model, monkeypatch):
    from outlines.backends.outlines_core import OutlinesCoreLogitsProcessor

    calls = []

    class Custom(OutlinesCoreLogitsProcessor):
        def _bias_logits_torch(self, batch_size, logits):
            calls.append("override")
            return logits

    index = _backend(model).get_regex_logits_processor(r"[0-9]+").index
    processor = Custom(index, "torch")
    vocab = _width(model)
    logits = torch.zeros((1, vocab))
    out = processor(torch.zeros((1, 1), dtype=torch.long), logits.clone())
    assert calls == ["override"] and torch.equal(out, logits)

    plain = OutlinesCoreLogitsProcessor(index, "torch")
    spied = []
    original = plain._bias_logits_torch
    monkeypatch.setattr(plain, "_bias_logits_torch", lambda b, x: spied.append(b) or original(b, x))
    plain(torch.zeros((1, 1), dtype=torch.long), logits.clone())
    assert spied == [1]


def test_test_doubles_for_outlines_core_constructors_are_used(model, monkeypatch):
    """A test that replaces the module's Vocabulary or Index sees its double called, store on or off."""
    import outlines.backends.outlines_core as module
    from outlines_core import Index, Vocabulary

    made = []

    def vocabulary_double(*args, **kwargs):
        made.append("vocabulary")
        return Vocabulary(*args, **kwargs)

    def index_double(*args, **kwargs):
        made.append("index")
        return Index(*args, **kwargs)

    monkeypatch.setattr(module, "Vocabulary", vocabulary_double)
    monkeypatch.setattr(module, "Index", index_double)
    mc.clear()
    for _ in range(2):  # the second time the store holds the vocabulary: the double must still run
        args = _converter_args(model, module.OutlinesCoreBackend.create_outlines_core_vocabulary)
        vocabulary = module.OutlinesCoreBackend.create_outlines_core_vocabulary(*args)
        backend = object.__new__(module.OutlinesCoreBackend)
        backend.vocabulary, backend.tensor_library_name = vocabulary, "torch"
        backend.get_regex_logits_processor(r"[0-9]+")
    assert made == ["vocabulary", "index"] * 2


def test_disabled_means_stock_whatever_install_did(model):
    """Inside disabled() every patched function is stock's own computation."""
    with mc.disabled():
        processor = _backend(model).get_regex_logits_processor(r"[0-9]{2}")
        logits = torch.randn((2, _width(model)))
        processor(torch.zeros((2, 1), dtype=torch.long), logits.clone())
    assert mc.stats()["hits"] == mc.stats()["misses"] == 0


def test_numpy_processor_equals_stock(model):
    vocab = _width(model)

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((1, vocab)).astype(np.float32)
    from outlines.backends.outlines_core import OutlinesCoreLogitsProcessor

    index = _backend(model).get_regex_logits_processor(r"(ab|cd){1,3}").index
    ours = OutlinesCoreLogitsProcessor(index, "numpy")(np.zeros((1, 1), dtype=np.int64), logits.copy())
    with mc.disabled():
        stock = OutlinesCoreLogitsProcessor(index, "numpy")(np.zeros((1, 1), dtype=np.int64), logits.copy())
    assert np.array_equal(ours, stock)
