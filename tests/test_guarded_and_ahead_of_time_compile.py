"""Guarded compiles (time limit, memory cap, a child process) and ahead-of-time compile into the store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import outlines_maskcache as mc
from outlines_maskcache.guard import CompileFailed, Worker

outlines_core = pytest.importorskip("outlines_core")
if not hasattr(outlines_core, "Index"):
    pytest.skip("outlines_core < 0.2 (the outlines 0.1-1.1 line) has no Index to compile", allow_module_level=True)
from outlines_core import Guide, Index, Vocabulary  # noqa: E402

#: A tiny vocabulary whose tokens are runs of one letter: compiles are fast
#: unless the regex's DFA is large, which is what these tests provoke.
VOCAB = Vocabulary(99, {chr(97 + i) * k: [i * 10 + k] for i in range(6) for k in range(1, 8)})
#: (a|b)*a(a|b){n}: a DFA of 2^n states; n=14 compiles in well under a
#: second, the prefix below makes the same shape need far more memory.
HEAVY = "[a-f]{0,400}(a|b)*a(a|b){12}"
SLOW = "(a|b)*a(a|b){16}"
HERE = Path(__file__).resolve().parent


def _same_walks(a: Index, b: Index, steps: int = 40) -> None:
    ga, gb = Guide(a), Guide(b)
    for _ in range(steps):
        assert sorted(ga.get_tokens()) == sorted(gb.get_tokens())
        tokens = sorted(ga.get_tokens())
        if ga.is_finished() or not tokens:
            return
        ga.advance(tokens[0], False)
        gb.advance(tokens[0], False)


def test_guarded_index_equals_an_in_process_compile():
    worker = Worker(max_bytes=1 << 30)
    try:
        data, seconds = worker.compile("regex", "(a|b)*a(a|b){5}c?", "v", VOCAB, timeout=60)
        again, _ = worker.compile("regex", "[a-f]{2,9}", "v", VOCAB, timeout=60)  # the vocabulary was sent once
    finally:
        worker.close()
    assert seconds >= 0
    _same_walks(Index.from_binary(data), Index("(a|b)*a(a|b){5}c?", VOCAB))
    _same_walks(Index.from_binary(again), Index("[a-f]{2,9}", VOCAB))


def test_timeout_kills_the_worker_and_the_next_compile_works():
    worker = Worker()
    with pytest.raises(CompileFailed) as err:
        worker.compile("regex", SLOW, "v", VOCAB, timeout=0.3)
    assert err.value.reason == "timeout"
    data, _ = worker.compile("regex", "[a-c]{1,4}", "v", VOCAB, timeout=30)  # a fresh worker, vocabulary re-sent
    worker.close()
    _same_walks(Index.from_binary(data), Index("[a-c]{1,4}", VOCAB))


def test_memory_cap_fails_that_compile_alone():
    worker = Worker(max_bytes=120 << 20)
    with pytest.raises(CompileFailed) as err:
        worker.compile("regex", HEAVY, "v", VOCAB, timeout=120)
    assert err.value.reason == "oom", err.value.message
    assert "out of memory" in str(err.value)
    data, _ = worker.compile("regex", "[a-c]{1,4}", "v", VOCAB, timeout=30)
    worker.close()
    assert Index.from_binary(data).get_initial_state() is not None


def test_unsupported_schema_is_a_compile_error():
    worker = Worker()
    try:
        with pytest.raises(CompileFailed) as err:
            worker.compile("json", "{not json", "v", VOCAB, timeout=30)
    finally:
        worker.close()
    assert err.value.reason == "error"


#: A real shape (MaskBench's Github_medium---o33692 has it): a recursive array
#: listed before optional properties.  outlines_core's schema -> regex
#: conversion repeats the recursion under every property ordering, so the
#: regex alone needs gigabytes (that schema asked for one 3.9 GB allocation
#: and took a whole benchmark process down with it); 8 properties exceed
#: 512 MiB in well under a second.
EXPLOSIVE_SCHEMA = json.dumps({"type": "object", "properties": {
    "kids": {"type": "array", "items": {"$ref": "#"}}, **{f"p{i}": {"type": "string"} for i in range(8)}}})


def test_schema_regex_is_built_in_the_worker_as_in_process():
    from outlines_maskcache.outlines_core_calls import schema_regex

    worker = Worker(max_bytes=1 << 30)
    try:
        schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}})
        assert worker.regex(schema, timeout=30) == schema_regex(schema)
        with pytest.raises(CompileFailed) as err:
            worker.regex("{not json", timeout=30)
        assert err.value.reason == "error"
    finally:
        worker.close()


def test_a_schema_whose_regex_exhausts_memory_fails_alone(tmp_path):
    """Ahead-of-time compile: the conversion runs under the worker's cap, never in the caller."""
    import resource

    from outlines_maskcache.ahead_of_time import Grammar, compile_all

    mc.configure(store=str(tmp_path / "store"))
    grammars = [Grammar("explosive", "json", EXPLOSIVE_SCHEMA), Grammar("fine", "regex", "[a-c]{1,4}")]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report = compile_all(grammars, VOCAB, "v", workers=1, timeout=60, max_bytes=512 << 20)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    statuses = {o.name: o.status for o in report.outcomes}
    assert statuses == {"explosive": "oom", "fine": "compiled"}, report.outcomes
    assert "out of memory" in report.outcomes[0].message
    assert grown_mib < 256, f"the caller grew by {grown_mib:.0f} MiB: the conversion ran in-process"


# -- through outlines ------------------------------------------------------------

outlines_core_backend = pytest.importorskip("outlines.backends.outlines_core", reason="outlines >= 1.2 backend")
from support.material import gpt2_tokenizer  # noqa: E402

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}


@pytest.fixture(scope="module")
def model(gpt2_outlines_model):
    return gpt2_outlines_model


def test_inline_guard_compiles_in_a_child_and_reports_timeouts(model, tmp_path):
    mc.configure(store=False, compile_timeout=120, compile_max_bytes=4 << 30)
    processor = outlines_core_backend.OutlinesCoreBackend(model).get_json_schema_logits_processor(json.dumps(SCHEMA))
    with mc.disabled():
        stock = outlines_core_backend.OutlinesCoreBackend(model).get_json_schema_logits_processor(json.dumps(SCHEMA))
    from outlines_maskcache.runtime import RUNTIME

    RUNTIME.settle()  # a lazy Index, if one was served first, is handed the guarded compile's Index
    assert isinstance(processor.index, Index), type(processor.index)
    _same_walks(processor.index, stock.index)
    # With the lazy Index on, a full compile past its limit is not raised: the lazy Index goes on
    # serving (tests/test_lazy_first_use.py).  Off, the guard's error reaches the caller.
    mc.configure(compile_timeout=0.05, lazy_index=False)
    with pytest.raises(CompileFailed) as err:
        outlines_core_backend.OutlinesCoreBackend(model).get_regex_logits_processor("[a-z]{1,200}@[a-z]{1,200}")
    assert err.value.reason == "timeout"
    with pytest.raises(mc.ConfigError):
        mc.configure(compile_timeout=0)
    with pytest.raises(mc.ConfigError):
        mc.configure(compile_max_bytes=1024)


def test_precompile_fills_the_store_a_new_backend_reads(model, tmp_path):
    mc.configure(store=str(tmp_path / "s"))
    schema_file = tmp_path / "city.json"
    schema_file.write_text(json.dumps(SCHEMA))
    report = mc.precompile(gpt2_tokenizer(), [schema_file, {"type": "object", "properties": {"n": {"type": "integer"}}}],
                           workers=1, timeout=120)
    assert report.summary()["compiled"] == 2, report.outcomes
    mc.clear()
    mc.reset_stats()
    outlines_core_backend.OutlinesCoreBackend(model).get_json_schema_logits_processor(json.dumps(SCHEMA))
    from outlines_maskcache.runtime import RUNTIME

    RUNTIME.settle()  # the lazy Index's token table is loaded on the background thread
    stats = mc.stats()["store"]
    # the vocabulary, the Index and the lazy Index's token table: all three were precompiled
    assert stats["hits"] == 3 and stats["misses"] == 0 and stats["writes"] == 0, stats
    again = mc.precompile(gpt2_tokenizer(), [schema_file], workers=1)
    assert again.summary()["stored"] == 1


def test_compile_command_over_a_maskbench_folder(tmp_path, capsys):
    from outlines_maskcache.cli import main

    mc.configure(store=str(tmp_path / "s"))
    folder = HERE / "data" / "maskbench"
    assert main(["compile", "--tokenizer", "gpt2", "--workers", "1", "--timeout", "120", str(folder)]) == 0
    first = capsys.readouterr().out
    assert "compiled 5," in first, first
    assert main(["compile", "--tokenizer", "gpt2", str(folder)]) == 0
    assert "already stored 5" in capsys.readouterr().out
    assert main(["store", "info"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["entries"] == 6  # the vocabulary and five Indexes
    assert main(["store", "clear"]) == 0
    assert "deleted 6 entries" in capsys.readouterr().out


def test_compile_command_rejects_bad_input(tmp_path):
    from outlines_maskcache.cli import main

    with pytest.raises(SystemExit, match="no schema file"):
        main(["compile", "--tokenizer", "gpt2", str(tmp_path / "missing.json")])
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(SystemExit, match="is not JSON"):
        main(["compile", "--tokenizer", "gpt2", str(bad)])
    with pytest.raises(SystemExit, match="no tokenizer"):
        main(["compile", "--tokenizer", "/nonexistent/tok", str(HERE / "data" / "maskbench")])


def test_inline_guard_covers_the_schema_to_regex_conversion(model):
    """A server with the guard on survives a schema whose conversion alone exhausts memory."""
    import resource

    from outlines_maskcache.outlines_core_calls import schema_regex

    mc.configure(store=False, compile_timeout=120, compile_max_bytes=512 << 20)
    backend = outlines_core_backend.OutlinesCoreBackend(model)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CompileFailed) as err:
        backend.get_json_schema_logits_processor(EXPLOSIVE_SCHEMA)
    assert err.value.reason == "oom", err.value.message
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024 < 256
    # The worker honours the caller's whitespace pattern: the same regex as stock's conversion.
    built = outlines_core_backend.build_regex_from_schema(json.dumps(SCHEMA), r"[ \n]{0,2}")
    assert built == schema_regex(json.dumps(SCHEMA), r"[ \n]{0,2}") != schema_regex(json.dumps(SCHEMA))
    # Guard off: the conversion is stock's, in process; uninstall restores the module's own name.
    mc.configure(compile_timeout=None, compile_max_bytes=None)
    assert outlines_core_backend.build_regex_from_schema(json.dumps(SCHEMA)) == schema_regex(json.dumps(SCHEMA))
    from outlines_core.json_schema import build_regex_from_schema

    mc.uninstall()
    try:
        assert outlines_core_backend.build_regex_from_schema is build_regex_from_schema
    finally:
        mc.install()
