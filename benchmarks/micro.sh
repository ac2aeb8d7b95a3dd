#!/usr/bin/env bash
# Per-step processor time, stock vs cached (warm and cold) vs xgrammar /
# llguidance vs the floors, in the realistic (cache-evicting) loop, at V = 50k (GPT-2) and 128k (Llama-3.2),
# B = 1, 8, 32, greedy and random walks, interleaved in one run.  Writes JSON and a plot.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; mkdir -p "$out"
.venv/bin/outlines-maskcache bench --tokenizers gpt2,llama3 --batch 1,8,32 --steps 24 --repeats 3 \
    --compile --memory --e2e --json "$out/micro.json" --plot "$out/micro.png" "${@:2}"
