"""SGLang's outlines grammar backend, driven the way its scheduler drives it, with and without the plugin.

Real objects of sglang (installed --no-deps beside the CPU torch, see
.ci/lanes/50-sglang.sh): ``OutlinesGrammarBackend`` over the real GPT-2
tokenizer, grammars created through SGLang's own cache entry point
(``get_cached_or_future_value`` / ``set_cache``, which hands every further
request a ``copy()`` sharing the guide), then per step
``allocate_vocab_mask`` -> ``fill_vocab_mask_batched`` -> ``apply_vocab_mask``
-> ``accept_token``, with several concurrent requests sharing one grammar
and rows in different states.  Every mask and every masked logits tensor
equals SGLang's own (run under ``disabled()``) bit for bit.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import outlines_maskcache as mc
from support.engine_plugins import assert_plugin_respects_master_switch

pytest.importorskip("sglang", reason="sglang is not installed (see .ci/lanes/50-sglang.sh)")
outlines_backend = pytest.importorskip("sglang.srt.constrained.outlines_backend")
from sglang.srt.constrained import base_grammar_backend  # noqa: E402
from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject  # noqa: E402

pytestmark = pytest.mark.e2e
HERE = Path(__file__).resolve().parent
SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                                      "age": {"type": "integer"}}, "required": ["name", "age"]})
REGEX = r"[a-z]{2,6}-[0-9]{1,3}@(ab|cd)\.(com|org)"


@pytest.fixture(scope="module")
def tokenizer(gpt2_hf_tokenizer):
    return gpt2_hf_tokenizer


@pytest.fixture(scope="module")
def backend(tokenizer):
    assert "sglang" in mc.install(targets=["sglang"])
    return outlines_backend.OutlinesGrammarBackend(tokenizer, whitespace_pattern=None)


def request(backend, key):
    """A grammar for one request, through SGLang's cache entry point, as the scheduler gets it."""
    value, cached = backend.get_cached_or_future_value(key, False)
    if not cached:
        value = value.result()
        backend.set_cache(key, value.copy())
    return value


def fill(cls, live, mask) -> None:
    """Fill the live rows as the installed SGLang's sampler does.

    SGLang 0.5.23 batches the rows (``fill_vocab_mask_batched`` over
    ``GrammarRow``s); 0.5.11 has neither and calls ``fill_vocab_mask`` per row.
    """
    row_type = getattr(base_grammar_backend, "GrammarRow", None)
    if row_type is not None and hasattr(cls, "fill_vocab_mask_batched"):
        cls.fill_vocab_mask_batched([row_type(row, g) for row, g in live], mask)
    else:
        for row, g in live:
            g.fill_vocab_mask(mask, row)


def drive(backend, grammars, width: int, steps: int, seed: int) -> int:
    """Scheduler-style steps over a batch of requests; compare with SGLang's own masks each step."""
    rng = random.Random(seed)
    cls = type(grammars[0])
    compared = 0
    for step in range(steps):
        live = [(row, g) for row, g in enumerate(grammars) if not getattr(g, "_done", False)]
        if not live:
            break
        mask = cls.allocate_vocab_mask(grammars[0], width, len(grammars), "cpu")
        fill(cls, live, mask)
        with mc.disabled():
            ref = cls.allocate_vocab_mask(grammars[0], width, len(grammars), "cpu")
            fill(cls, live, ref)
        assert torch.equal(mask, ref), f"mask differs from SGLang's at step {step}"
        logits = torch.randn(len(grammars), width, generator=torch.Generator().manual_seed(seed * 1000 + step))
        expected = logits.clone()
        cls.apply_vocab_mask(logits, mask)
        with mc.disabled():
            cls.apply_vocab_mask(expected, ref)
        assert torch.equal(logits.view(torch.int32), expected.view(torch.int32))
        compared += 1
        for row, g in live:
            allowed = (~ref[row]).nonzero().flatten().tolist()
            if not allowed:
                g._done = True
                continue
            token = rng.choice(allowed)
            if token == backend.outlines_tokenizer.eos_token_id:
                g._done = True
                continue
            g.accept_token(token)
    return compared


def test_plugin_entry_point_is_declared():
    points = importlib.metadata.entry_points(group="sglang.srt.plugins")
    assert any(p.value == "outlines_maskcache.plugins:sglang" for p in points)


def test_shared_grammar_rows_in_different_states_equal_sglang(backend, tokenizer):
    width = len(tokenizer)
    key = ("json", SCHEMA)
    batch = [request(backend, key) for _ in range(5)] + [request(backend, ("regex", REGEX)) for _ in range(2)]
    assert batch[1].guide is batch[0].guide, "SGLang shares one guide between requests of one schema"
    assert drive(backend, batch, width, steps=30, seed=1) > 5
    first = mc.stats()
    assert first["hits"] > 0 and first["misses"] > 0 and first["fallbacks"] == 0, first
    # New requests with the same schemas, walking the same paths: served from what the first ones cached.
    again = [request(backend, key) for _ in range(5)] + [request(backend, ("regex", REGEX)) for _ in range(2)]
    drive(backend, again, width, steps=30, seed=1)
    second = mc.stats()
    assert second["misses"] == first["misses"] and second["hits"] > first["hits"]


def test_real_schemas_equal_sglang(backend, tokenizer):
    from outlines_maskcache.bench.maskbench import load_dataset

    driven = 0
    for n, grammar in enumerate(load_dataset(HERE.parent / "data" / "maskbench")):
        batch = [request(backend, ("json", grammar.spec)) for _ in range(3)]
        if isinstance(batch[0], InvalidGrammarObject):  # SGLang's validator rejects some real schemas
            continue
        drive(backend, batch, len(tokenizer), steps=25, seed=10 + n)
        driven += 1
    assert driven >= 3
    assert mc.stats()["fallbacks"] == 0


def test_mask_wider_than_the_vocabulary_and_stock_errors(backend, tokenizer):
    batch = [request(backend, ("regex", REGEX)) for _ in range(2)]
    drive(backend, batch, len(tokenizer) + 64, steps=5, seed=3)  # padded vocabulary, as model heads often are
    grammar = request(backend, ("regex", REGEX))
    narrow = torch.zeros(1, 10, dtype=torch.bool)  # allowed ids past the row: SGLang's own error, unchanged
    with pytest.raises(RuntimeError) as cached_err:
        grammar.fill_vocab_mask(narrow, 0)
    with mc.disabled(), pytest.raises(RuntimeError) as stock_err:
        grammar.fill_vocab_mask(torch.zeros(1, 10, dtype=torch.bool), 0)
    assert type(cached_err.value) is type(stock_err.value)


def test_fault_falls_back_to_sglang(backend, tokenizer, monkeypatch):
    from outlines_maskcache.targets import sglang as adapter

    grammar = request(backend, ("json", SCHEMA))
    def broken(*args, **kwargs):
        raise MemoryError("injected")

    monkeypatch.setattr(adapter, "cached_value", broken)
    mask = grammar.allocate_vocab_mask(len(tokenizer), 1, "cpu")
    grammar.fill_vocab_mask(mask, 0)
    with mc.disabled():
        ref = grammar.allocate_vocab_mask(len(tokenizer), 1, "cpu")
        grammar.fill_vocab_mask(ref, 0)
    assert torch.equal(mask, ref)
    assert mc.stats()["fallbacks"] == 1


def test_plugin_respects_master_switch(monkeypatch):
    from outlines_maskcache import plugins

    assert_plugin_respects_master_switch(monkeypatch, plugins.sglang, "sglang")


_CHILD = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from sglang.srt.plugins import load_plugins
    load_plugins()  # what run_scheduler_process does first
    import outlines_maskcache as mc
    from support.material import gpt2_tokenizer
    from sglang.srt.constrained.outlines_backend import OutlinesGrammarBackend
    tok = gpt2_tokenizer()
    backend = OutlinesGrammarBackend(tok, whitespace_pattern=None)
    grammar = backend.dispatch_regex(sys.argv[2])
    for _ in range(3):
        mask = grammar.allocate_vocab_mask(len(tok), 1, "cpu")
        grammar.fill_vocab_mask(mask, 0)
    from outlines_maskcache import stats_file
    stats_file.write()
    print(json.dumps({"targets": mc.installed_targets()}))
""")


def test_plugin_is_loaded_in_a_spawned_process_through_the_entry_point(tmp_path):
    env = dict(os.environ, OUTLINES_MASKCACHE_STATS_FILE=str(tmp_path / "stats-{pid}.json"), SGLANG_PLUGINS="outlines_maskcache")
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(HERE.parent), REGEX], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sglang" in json.loads(proc.stdout.strip().splitlines()[-1])["targets"]
    files = list(tmp_path.glob("stats-*.json"))
    assert len(files) == 1
    stats = json.loads(files[0].read_text())
    assert stats["hits"] == 2 and stats["misses"] == 1 and stats["fallbacks"] == 0, stats
