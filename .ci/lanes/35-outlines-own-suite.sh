#!/usr/bin/env bash
# outlines' own test suite, from the newest tested outlines release's sdist,
# run stock, then with the package imported over an empty store, then over
# the store that run filled: every test's outcome must be stock's
# (scripts/outlines_own_suite.py says how the hub models are stood in for).
# Runs in the main venv (.venv, outlines 1.3.3) after the llama.cpp session,
# which leaves llama-cpp-python and SmolLM2's GGUF there (outlines' backend
# tests load a llama.cpp model at import); both scripts are no-ops for what
# is already installed.  Adds what outlines' test modules import beyond it:
# airportsdata and iso3166 (custom types) and pytest-mock.  In CI this is
# the last session on .venv, and removes it.
set -euo pipefail
cd "$(dirname "$0")/../.."
reports="${MASKCACHE_REPORTS:-.ci/out}"; mkdir -p "$reports"
version=$(python3 outlines_maskcache/versions.py outlines-core-backend | tail -n 1)
bash scripts/setup.sh .venv "outlines==$version"
[ "${MASKCACHE_CI_LEAN:-0}" = 1 ] && trap 'rm -rf .venv' EXIT
bash scripts/install_llamacpp.sh .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
pip install "airportsdata==20260905" "iso3166==3.0.0" "pytest-mock==3.17.0"
work="$reports/outlines-own-suite"; rm -rf "$work" && mkdir -p "$work"
pip download --no-deps --no-binary :all: "outlines==$version" -d "$work"
tar -xzf "$work/outlines-$version.tar.gz" -C "$work"
.venv/bin/python scripts/outlines_own_suite.py "$work/outlines-$version" "$work/reports"
