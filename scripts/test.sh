#!/usr/bin/env bash
# Set up and run the whole test suite on a fresh machine: every session of
# the version matrix (noxfile.py; `nox -l` lists them) in order, each with
# its log, then one summary line over all of them.  Exit status: non-zero
# if any session failed.
#
# nox itself lives in its own small venv (.venv-nox); each session's lane
# script builds the environment it tests (.ci/lanes/, scripts/setup.sh,
# torch from the local CPU wheel).  Each session's output is also kept in
# $MASKCACHE_REPORTS/lane-NAME.log, and the end of a failed session's log is
# printed again after the summary: CI shows only the tail of what a run
# prints, and a session that dies before pytest writes its report (an
# install step, a killed process) would otherwise leave nothing there but a
# missing count.
#
# MASKCACHE_CI_LEAN=1 (set by .ci/run) makes each lane remove the venvs no
# later lane uses; the free disk space is printed as each session starts, so
# an install that dies of a full disk is recognisable from the log alone.
# NOX_SESSIONS (comma-separated) runs a subset.
set -uo pipefail
cd "$(dirname "$0")/.."
export MASKCACHE_REPORTS="$PWD/.ci/out"
rm -rf "$MASKCACHE_REPORTS" && mkdir -p "$MASKCACHE_REPORTS"
nox_venv=".venv-nox"
[ -x "$nox_venv/bin/nox" ] || { python3 -m venv "$nox_venv" && "$nox_venv/bin/python" -m pip --disable-pip-version-check -q install "nox>=2024.10.9"; } \
    || { echo "cannot install nox"; exit 1; }
if [ -n "${NOX_SESSIONS:-}" ]; then
    IFS=, read -r -a sessions <<<"$NOX_SESSIONS"
else
    mapfile -t sessions < <("$nox_venv/bin/nox" --list --json | python3 -c "import json, sys; print('\n'.join(s['session'] for s in json.load(sys.stdin)))")
fi
[ "${#sessions[@]}" -gt 0 ] || { echo "nox listed no sessions"; exit 1; }
status=0
failed=()
for session in "${sessions[@]}"; do
  name="$(echo "$session" | tr -c 'A-Za-z0-9._\n-' '-')"
  log="$MASKCACHE_REPORTS/lane-$name.log"
  echo "=== session $session: start $(date -u +%H:%M:%S), $(df -Ph . | awk 'NR==2 {print $4}') free on disk"
  start=$(date +%s)
  "$nox_venv/bin/nox" -s "$session" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 0 ]; then
    echo "=== session $session: passed in $(( $(date +%s) - start ))s"
  else
    echo "=== session $session: FAILED (exit $rc) after $(( $(date +%s) - start ))s"
    failed+=("$name:$rc")
    status=1
  fi
done
python3 scripts/summarize.py "$MASKCACHE_REPORTS" || status=1
for entry in ${failed[@]+"${failed[@]}"}; do
  name="${entry%:*}"; rc="${entry##*:}"
  echo "=== session $name failed with exit $rc; the last lines of its output (pip's index warnings left out):"
  grep -v "^WARNING: Location '" "$MASKCACHE_REPORTS/lane-$name.log" | tail -n 60
done
exit $status
