#!/usr/bin/env bash
# Set up and run the whole test suite on a fresh machine: every lane in
# .ci/lanes/ in order (main outlines line, legacy outlines lines, llama.cpp,
# vLLM), then one summary line over all of them.  Exit status: non-zero if
# any lane failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export MASKCACHE_REPORTS="$PWD/.ci/out"
rm -rf "$MASKCACHE_REPORTS" && mkdir -p "$MASKCACHE_REPORTS"
status=0
for lane in .ci/lanes/*.sh; do
  name="$(basename "$lane" .sh)"
  echo "=== lane $name: start $(date -u +%H:%M:%S)"
  start=$(date +%s)
  if bash "$lane"; then
    echo "=== lane $name: passed in $(( $(date +%s) - start ))s"
  else
    echo "=== lane $name: FAILED after $(( $(date +%s) - start ))s"
    status=1
  fi
done
python3 scripts/summarize.py "$MASKCACHE_REPORTS" || status=1
exit $status
