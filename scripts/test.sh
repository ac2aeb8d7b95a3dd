#!/usr/bin/env bash
# Set up and run the whole test suite on a fresh machine: every lane in
# .ci/lanes/ in order (main outlines line, legacy outlines lines, llama.cpp,
# vLLM, SGLang), then one summary line over all of them.  Exit status:
# non-zero if any lane failed.
#
# Each lane's output is also kept in $MASKCACHE_REPORTS/lane-NAME.log, and
# the end of a failed lane's log is printed again after the summary: CI
# shows only the tail of what a run prints, and a lane that dies before
# pytest writes its report (an install step, a killed process) would
# otherwise leave nothing there but a missing count.
#
# MASKCACHE_CI_LEAN=1 (set by .ci/run) makes each lane remove the venvs no
# later lane uses; the free disk space is printed as each lane starts, so an
# install that dies of a full disk is recognisable from the log alone.
set -uo pipefail
cd "$(dirname "$0")/.."
export MASKCACHE_REPORTS="$PWD/.ci/out"
rm -rf "$MASKCACHE_REPORTS" && mkdir -p "$MASKCACHE_REPORTS"
status=0
failed=()
for lane in .ci/lanes/*.sh; do
  name="$(basename "$lane" .sh)"
  log="$MASKCACHE_REPORTS/lane-$name.log"
  echo "=== lane $name: start $(date -u +%H:%M:%S), $(df -Ph . | awk 'NR==2 {print $4}') free on disk"
  start=$(date +%s)
  bash "$lane" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 0 ]; then
    echo "=== lane $name: passed in $(( $(date +%s) - start ))s"
  else
    echo "=== lane $name: FAILED (exit $rc) after $(( $(date +%s) - start ))s"
    failed+=("$name:$rc")
    status=1
  fi
done
python3 scripts/summarize.py "$MASKCACHE_REPORTS" || status=1
for entry in ${failed[@]+"${failed[@]}"}; do
  name="${entry%:*}"; rc="${entry##*:}"
  hint=""; [ "$rc" -ge 128 ] && hint=" (killed by signal $((rc - 128)))"
  echo "=== lane $name failed with exit $rc$hint; the last lines of its output (pip's index warnings left out):"
  grep -v "^WARNING: Location '" "$MASKCACHE_REPORTS/lane-$name.log" | tail -n 60
done
exit $status
