#!/usr/bin/env bash
# Main lane: newest supported outlines (1.3.x) — the whole core suite, then
# the benchmark once in quick mode to prove it runs (benchmarks are never
# timed tests).
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup.sh .venv "outlines==1.3.3"
# mlx-lm on Linux (mlx[cpu]): tests/test_mlx_masking.py generates through outlines.from_mlxlm.
.venv/bin/python -m pip --disable-pip-version-check -q install \
    "mlx[cpu]==$(python3 outlines_maskcache/versions.py mlx)" "mlx-lm==$(python3 outlines_maskcache/versions.py mlx-lm)"
PYTHON=.venv/bin/python bash scripts/fetch_schemas.sh
reports="${MASKCACHE_REPORTS:-.ci/out}"; mkdir -p "$reports"
# Architecture contracts (pyproject.toml [tool.importlinter]): no import circles, cores free of outlines and engines.
.venv/bin/lint-imports
.venv/bin/python -m pytest -q tests --ignore=tests/engines --junitxml="$reports/main-outlines-1.3.3.xml"
# The long hypothesis profile, once, on the newest release (~1 min): cached == stock over random regexes and
# vocabularies, the interegular oracle, and the lazy Index == the full one, 600 examples each.
HYPOTHESIS_PROFILE=nightly .venv/bin/python -m pytest -q tests/test_processor_equals_stock.py \
    tests/test_masks_against_regex_oracle.py tests/test_lazy_index_equals_full.py \
    -k "random_regex_random_vocab or oracle or random_regexes_and_vocabularies" \
    --junitxml="$reports/main-outlines-1.3.3-nightly-profile.xml"
.venv/bin/outlines-maskcache bench --quick --compile --memory --json "$reports/bench-quick.json" --plot "$reports/bench-quick.png"
# The MaskBench replay through its command, on three real schemas (conformance is asserted: exit 1 on any disagreement).
OUTLINES_MASKCACHE_STORE="$reports/store" .venv/bin/outlines-maskcache bench maskbench --sample 3 --tokenizer gpt2 --timeout 60 \
    --engines outlines,maskcache,maskcache-warm,maskcache-stored,outlines-logits,maskcache-logits,llguidance,xgrammar \
    --json "$reports/maskbench-quick.json" --plot "$reports/maskbench-quick.png"
