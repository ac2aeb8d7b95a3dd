#!/usr/bin/env bash
# outlines-core-backend releases other than the newest (which the main lane
# runs in full): equivalence with stock at every step, generation, the
# parity checks, the lazy Index proof (outlines_core 0.2.11) and a hypothesis subset, in one venv (.venv-backend) that
# switches the outlines release.  Usage: 15-outlines-backend.sh VERSION...
# (nox passes one release per session; no argument runs every release the
# tested matrix lists but the newest).
set -euo pipefail
cd "$(dirname "$0")/../.."
reports="${MASKCACHE_REPORTS:-.ci/out}"; mkdir -p "$reports"
venv=".venv-backend"
versions=("$@")
if [ "${#versions[@]}" -eq 0 ]; then
    mapfile -t versions < <(python3 outlines_maskcache/versions.py outlines-core-backend | head -n -1)
fi
for version in "${versions[@]}"; do
    start=$SECONDS
    if [ -x "$venv/bin/python" ]; then
        "$venv/bin/python" -m pip --disable-pip-version-check -q install "outlines==$version"
    else
        bash scripts/setup.sh "$venv" "outlines==$version"
    fi
    "$venv/bin/python" -m pytest -q tests/test_backend_matches_its_release.py tests/test_processor_equals_stock.py tests/test_install_disable_stats.py \
        tests/test_shared_cache_state_machine.py tests/test_transformers_generation.py tests/test_masks_against_regex_oracle.py \
        tests/test_lazy_index_equals_full.py tests/test_lazy_first_use.py tests/test_lazy_guide_equals_guide.py \
        --junitxml="$reports/outlines-backend-$version.xml"
    echo "outlines-backend lane: outlines $version passed in $((SECONDS - start)) s"
done
# Lean (CI): the venv is used by the backend sessions only; the newest release's session of them removes it.
last=$(python3 outlines_maskcache/versions.py outlines-core-backend | tail -n 2 | head -n 1)
if [ "${MASKCACHE_CI_LEAN:-0}" = 1 ] && [ "${versions[-1]}" = "$last" ]; then rm -rf "$venv"; fi
