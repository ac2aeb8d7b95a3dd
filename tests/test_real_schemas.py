"""Real-world JSON Schemas no one here wrote: every one outlines can compile walks cached == stock.

Sources (fetched from PyPI by scripts/fetch_schemas.sh): the
JSON-Schema-Test-Suite in jsonschema's source archive and the SchemaStore
schemas vendored in check-jsonschema.  Compiling is done in the package's
guarded worker (outlines_maskcache.guard) with a per-schema time limit and
memory cap, since a few schemas take minutes and some regexes they produce
run to hundreds of MB (one here: 310 MB), which an uncapped compile can turn
into an OOM kill of the test process; how many compiled, timed out, ran out
of memory or were unsupported is reported, never hidden.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

import outlines_maskcache as mc
from conftest import nightly
from support.drivers import walk
from support.material import gpt2_tokenizer
from support.versions import requires_outlines_core_backend

pytestmark = requires_outlines_core_backend

ROOT = Path(__file__).resolve().parents[1] / ".cache" / "schemas"
#: each compile's address space in the guarded worker
COMPILE_MAX_BYTES = 2 << 30


def load_schemas() -> list[tuple[str, dict]]:
    suite = ROOT / "json-schema-test-suite"
    drafts = ["draft2020-12", "draft7"] if not nightly() else sorted(p.name for p in suite.iterdir() if p.is_dir())
    found: list[tuple[str, dict]] = []
    for draft in drafts:
        for path in sorted((suite / draft).glob("*.json")):
            for n, case in enumerate(json.loads(path.read_text())):
                if isinstance(case.get("schema"), dict):
                    found.append((f"{draft}/{path.stem}#{n}", case["schema"]))
    for path in sorted((ROOT / "schemastore").glob("*.json")):
        found.append((f"schemastore/{path.stem}", json.loads(path.read_text())))
    return found


def _vocabulary():
    """GPT-2's real vocabulary; in the ci profile its first 2,300 tokens (all bytes + common merges)."""
    from outlines_core import Vocabulary
    from outlines.models.transformers import TransformerTokenizer

    tok = TransformerTokenizer(gpt2_tokenizer())
    limit = None if nightly() else 2300
    items: dict[str, list[int]] = {}
    for token, token_id in tok.get_vocab().items():
        if (limit is None or token_id < limit) and token_id != tok.eos_token_id:
            items.setdefault(tok.convert_token_to_string(token), []).append(token_id)
    width = (max(tok.get_vocab().values()) if limit is None else limit) + 1
    return Vocabulary(tok.eos_token_id, items), tok.eos_token_id, width


def test_real_world_schemas_cached_equals_stock():
    from outlines_core.json_schema import build_regex_from_schema

    if not ROOT.exists():
        if os.environ.get("CI"):
            pytest.fail("real schemas missing: .ci lanes must run scripts/fetch_schemas.sh")
        pytest.skip("run scripts/fetch_schemas.sh to fetch the real schemas")
    schemas = load_schemas()
    regexes: dict[str, str] = {}
    unsupported = 0
    for name, schema in schemas:
        try:
            regexes.setdefault(build_regex_from_schema(json.dumps(schema)), name)
        except Exception:  # noqa: BLE001 - outlines cannot express it; counted
            unsupported += 1
    from outlines_core import Index

    from outlines_maskcache.guard import CompileFailed, Worker

    vocabulary, eos, n_ids = _vocabulary()
    per_schema = 120.0 if nightly() else 6.0
    budget = 3600.0 if nightly() else 200.0
    started = time.monotonic()
    worker = Worker(COMPILE_MAX_BYTES)
    outcome = {"compiled": 0, "agreed": 0, "timed_out": 0, "out_of_memory": 0, "rejected_by_index": 0,
               "crashed": 0, "not_reached": 0}
    failed_as = {"timeout": "timed_out", "oom": "out_of_memory", "error": "rejected_by_index", "crash": "crashed"}
    rng = np.random.default_rng(0)
    by_source: dict[str, int] = {}
    try:
        for regex, name in sorted(regexes.items(), key=lambda kv: len(kv[0])):
            if time.monotonic() - started > budget:
                outcome["not_reached"] += 1
                continue
            try:
                data, _ = worker.compile("regex", regex, "gpt2-test-vocabulary", vocabulary, per_schema)
            except CompileFailed as err:  # error: "no transitions", the vocabulary cannot spell it
                outcome[failed_as[err.reason]] += 1
                continue
            index = Index.from_binary(data)
            outcome["compiled"] += 1
            source = "schemastore" if name.startswith("schemastore/") else "test_suite"
            by_source[source] = by_source.get(source, 0) + 1
            walk(index, eos, rng, batch=3, steps=8, width=n_ids + 5, eos_bias=0.02)
            outcome["agreed"] += 1
    finally:
        worker.close()
    stats = mc.stats()
    summary = {"schemas": len(schemas), "unsupported_by_outlines": unsupported, "distinct_regexes": len(regexes),
               **outcome, "compiled_by_source": by_source, "mismatches": outcome["compiled"] - outcome["agreed"], "cache_hits": stats["hits"],
               "fallbacks": stats["fallbacks"], "vocabulary_tokens": n_ids, "seconds": round(time.monotonic() - started, 1),
               "per_schema_limit_s": per_schema, "per_schema_max_bytes": COMPILE_MAX_BYTES}
    print(json.dumps(summary))
    folder = os.environ.get("MASKCACHE_REPORTS")
    if folder:
        Path(folder, "reliability-real-schemas.json").write_text(json.dumps(summary, indent=2))
    assert outcome["compiled"] >= 50, summary
    assert stats["fallbacks"] == 0
