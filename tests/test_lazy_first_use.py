"""A never-seen regex served by the lazy Index, then handed to the full one (#29), through outlines' own processor.

The stock processor (under ``disabled()``, on outlines_core's full Index)
and the cached one (on the lazy Index, its guides ``LazyGuide``) run in
lockstep over random allowed-token paths with rows in different states,
resets, EOS and logits wider than the vocabulary: every step's logits are
bit-identical.  Then the full compile, held back until now, hands over:
the processor's Index becomes outlines_core's, the memo serves it to new
processors, and the masks cached under the lazy Index stay valid.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

import outlines_maskcache as mc
from outlines_maskcache import lazy_compile
from outlines_maskcache.config import settings_from_env
from outlines_maskcache.lazy_index import LazyGuide, LazyIndex
from outlines_maskcache.runtime import RUNTIME
from support.drivers import Lockstep, walk
from support.material import gpt2_tokenizer
from support.versions import requires_outlines_core_backend

pytestmark = requires_outlines_core_backend

SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                      "age": {"type": "integer"}, "ok": {"type": "boolean"}},
                     "required": ["name", "age"]})


@pytest.fixture
def backend():
    from outlines.backends.outlines_core import OutlinesCoreBackend

    from support.material import tiny_model

    pytest.importorskip("torch")
    import outlines

    tok = gpt2_tokenizer()
    if tok is None:
        pytest.skip("no GPT-2 tokenizer package")
    return OutlinesCoreBackend(outlines.from_transformers(tiny_model(tok), tok))


@pytest.fixture
def held_back():
    """Hold the background thread (full compiles, store writes) until the test lets it go."""
    gate = threading.Event()
    RUNTIME.background.submit("test gate", gate.wait)
    yield gate
    gate.set()
    RUNTIME.settle()


def test_first_processor_is_lazy_equal_to_stock_and_handed_over(backend, held_back):
    from outlines_core import Index

    mc.configure(lazy_index=True)
    processor = backend.get_json_schema_logits_processor(SCHEMA)
    lazy = processor.index
    assert isinstance(lazy, LazyIndex), type(lazy)
    assert mc.stats()["lazy_index"]["served"] == 1
    from outlines_maskcache import outlines_core_calls as core

    full = Index(core.schema_regex(SCHEMA), backend.vocabulary)
    width = len(gpt2_tokenizer()) + 64  # logits wider than the vocabulary
    eos = gpt2_tokenizer().eos_token_id
    pair = Lockstep(full, "torch", cached_index=lazy)
    for seed in range(3):
        walk(full, eos, np.random.default_rng(seed), batch=4, steps=30, width=width, library="torch", lockstep=pair)
        pair.reset()
    assert all(isinstance(g, LazyGuide) for g in pair.cached._guides)
    assert mc.stats()["lazy_index"]["states_built"] > 3
    # A second processor for the schema before the hand-over shares the lazy Index.
    second = backend.get_json_schema_logits_processor(SCHEMA)
    assert second.index is lazy
    held_back.set()
    lazy_compile.settle()
    assert isinstance(processor.index, Index)
    stats = mc.stats()["lazy_index"]
    assert stats["handed_over"] == 2 and stats["full_failed"] == 0 and stats["on"]
    assert RUNTIME.fingerprint(processor.index) == RUNTIME.fingerprint(lazy)
    assert isinstance(backend.get_json_schema_logits_processor(SCHEMA).index, Index)
    # After the hand-over the pair goes on equal (the lazy guides keep serving the rows until a reset).
    walk(full, eos, np.random.default_rng(9), batch=3, steps=20, width=width, library="torch", lockstep=pair)
    assert isinstance(second.index, Index)


def test_under_disabled_a_lazy_processor_runs_stock_code_with_equal_masks(backend, held_back):
    from outlines_core import Index

    from outlines_maskcache import outlines_core_calls as core

    mc.configure(lazy_index=True)
    lazy = backend.get_json_schema_logits_processor(SCHEMA).index
    full = Index(core.schema_regex(SCHEMA), backend.vocabulary)
    pair = Lockstep(full, "numpy", cached_index=lazy)
    eos = gpt2_tokenizer().eos_token_id
    with mc.disabled():  # both processors stock: the lazy one through LazyGuide and outlines_core's kernels
        walk(full, eos, np.random.default_rng(1), batch=2, steps=25, width=len(gpt2_tokenizer()), library="numpy",
             lockstep=pair)


def test_off_refused_and_stored_regexes_get_the_full_index(backend):
    from outlines_core import Index

    mc.configure(lazy_index=False)
    assert isinstance(backend.get_regex_logits_processor("[0-9]{3}").index, Index)
    assert mc.stats()["lazy_index"]["on"] is False
    mc.configure(lazy_index=True)
    # An assertion with a state after a complete match: the probe is not trusted, so no lazy Index.
    assert isinstance(backend.get_regex_logits_processor("((ab)+)$?").index, Index)
    assert mc.stats()["lazy_index"]["refused"] == 1
    # A regex already in the store is loaded, not walked lazily.
    RUNTIME.settle()  # the store write of the first compile
    RUNTIME.grammar_memo.clear()
    assert isinstance(backend.get_regex_logits_processor("[0-9]{3}").index, Index)
    assert mc.stats()["lazy_index"]["served"] == 0
    assert mc.stats()["store"]["hits"] >= 1


def test_a_failed_full_compile_leaves_the_lazy_index_serving(backend, monkeypatch):
    from outlines_maskcache import compiled

    mc.configure(lazy_index=True)

    def fails(*args, **kwargs):
        raise MemoryError("compile guard: out of memory")

    monkeypatch.setattr(compiled, "compile_index", fails)
    processor = backend.get_regex_logits_processor("[a-c]{2,5}x")
    lazy_compile.settle()
    assert isinstance(processor.index, LazyIndex)
    assert mc.stats()["lazy_index"]["full_failed"] == 1
    assert backend.get_regex_logits_processor("[a-c]{2,5}x").index is processor.index


def test_a_hand_over_that_finds_a_difference_switches_lazy_off(backend, monkeypatch, held_back):
    mc.configure(lazy_index=True)
    processor = backend.get_regex_logits_processor("[a-c]{2,5}y")
    lazy = processor.index
    lazy.row(lazy.initial_state)

    class Wrong:
        def get_initial_state(self):
            return lazy.initial_state

        def get_allowed_tokens(self, state):
            return [0]

        def is_final_state(self, state):
            return False

    assert lazy_compile._first_difference(lazy, Wrong()) is not None
    held_back.set()
    lazy_compile.settle()
    assert lazy_compile._first_difference(lazy, processor.index) is None  # the real hand-over found none
    monkeypatch.setattr(lazy_compile, "_first_difference", lambda lazy, full: "state 0: allowed tokens")
    other = backend.get_regex_logits_processor("[a-c]{2,5}z")
    lazy_compile.settle()
    assert isinstance(other.index, LazyIndex) is False
    on, why = lazy_compile.enabled()
    assert not on and "differed" in why
    mc.clear()
    assert lazy_compile.enabled()[0]


def test_uninstall_waits_for_the_hand_over(backend, held_back):
    from outlines_core import Index

    mc.configure(lazy_index=True)
    processor = backend.get_regex_logits_processor("[a-c]{2,5}w")
    assert isinstance(processor.index, LazyIndex)
    held_back.set()
    mc.uninstall()
    try:
        assert isinstance(processor.index, Index)
        processor.reset()  # stock's own _setup with stock's Guide works on it again
    finally:
        mc.install()


def test_the_switch_by_environment_and_by_release(monkeypatch):
    assert settings_from_env({"OUTLINES_MASKCACHE_LAZY_INDEX": "0"}).lazy_index is False
    assert settings_from_env({"OUTLINES_MASKCACHE_LAZY_INDEX": "on"}).lazy_index is True
    with pytest.warns(RuntimeWarning, match="LAZY_INDEX"):
        assert settings_from_env({"OUTLINES_MASKCACHE_LAZY_INDEX": "maybe"}).lazy_index is None
    with pytest.raises(mc.ConfigError):
        mc.configure(lazy_index="yes")
    from outlines_maskcache import outlines_core_calls as core

    monkeypatch.setattr(core, "version", lambda: "0.2.99")
    mc.configure(lazy_index=None)
    on, why = lazy_compile.enabled()
    assert not on and "0.2.99" in why
    mc.configure(lazy_index=True)
    on, why = lazy_compile.enabled()
    assert on and "forced" in why


def test_with_the_compile_guard_the_byte_level_indexes_are_built_in_its_worker(backend, held_back, monkeypatch):
    from outlines_core import Index

    from outlines_maskcache import guard

    names = []
    real = guard.compile_index
    monkeypatch.setattr(guard, "compile_index", lambda regex, vocabulary, name, *limits: (names.append(name),
                                                                                         real(regex, vocabulary, name,
                                                                                              *limits))[1])
    mc.configure(lazy_index=True, compile_timeout=60, compile_max_bytes=2 << 30)
    regex = r'"([a-z]|é)*"( ?\+ ?"([a-z]|é)*")*'  # goes on past a complete match: the probe is built too
    processor = backend.get_regex_logits_processor(regex)
    assert isinstance(processor.index, LazyIndex)
    assert names[0] == "lazy:bytes" and any(n.startswith("lazy:probe:") for n in names), names
    full = Index(regex, backend.vocabulary)
    pair = Lockstep(full, "numpy", cached_index=processor.index)
    walk(full, gpt2_tokenizer().eos_token_id, np.random.default_rng(4), batch=3, steps=25,
         width=len(gpt2_tokenizer()), library="numpy", lockstep=pair)


def test_the_token_table_is_stored_beside_the_vocabulary(backend):
    mc.configure(lazy_index=True)
    backend.get_regex_logits_processor("[a-c]{2,5}v")
    lazy_compile.settle()
    hits = mc.stats()["store"]["hits"]
    lazy_compile.LAZY.tables.clear()  # what a new process starts with
    own, source = backend.__dict__["_outlines_maskcache_vocabulary"]
    table = lazy_compile._table(source)
    assert mc.stats()["store"]["hits"] == hits + 1 and table.vocab_size > 40_000
