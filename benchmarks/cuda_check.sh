#!/usr/bin/env bash
# The GPU check as one prepared run (see benchmarks/cuda_check.py): on a CUDA
# machine with this repo, sets up the main venv (the CUDA torch already
# there is kept: setup.sh never replaces an existing torch) and writes
# OUT/cuda_check.json.  Usage: bash benchmarks/cuda_check.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-bench-out}}"; mkdir -p "$out"
[ -x .venv/bin/python ] || bash scripts/setup.sh .venv "outlines==1.3.3"
PYTHONUNBUFFERED=1 .venv/bin/python benchmarks/cuda_check.py --device "${DEVICE:-cuda}" --out "$out" 2>&1 | tee "$out/cuda_check.log"
