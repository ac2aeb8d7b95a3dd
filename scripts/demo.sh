#!/usr/bin/env bash
# Set up .venv and run the demo: stock vs cached per-step mask time on the
# real GPT-2 tokenizer with a small local model, and identical generations.
# Nothing is downloaded from a model hub.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh .venv "outlines==1.3.3" >/dev/null
exec .venv/bin/outlines-maskcache demo "$@"
