#!/usr/bin/env bash
# Legacy lane: the outlines 0.1.x-1.1.x line (GuideLogitsProcessor over a
# Python RegexGuide, patched by the "guide-processor" target), one venv per
# tested release (outlines_maskcache/versions.py, or the releases given as
# arguments), the whole shared suite in each (tests for other lines skip).
#
# Extras this line needs beyond scripts/setup.sh: `datasets`, which
# outlines' TransformerTokenizer.__hash__ imports (the index build is
# lru-cached on the tokenizer; an older datasets on 0.1.x, whose numpy < 2
# pin rules out datasets 5).  Every release runs on transformers 5.x.
set -euo pipefail
cd "$(dirname "$0")/../.."
reports="${MASKCACHE_REPORTS:-.ci/out}"; mkdir -p "$reports"
failed=()
versions=("$@")
[ "${#versions[@]}" -eq 0 ] && mapfile -t versions < <(python3 outlines_maskcache/versions.py guide-processor)
for version in "${versions[@]}"; do
    venv=".venv-outlines-$version"
    start=$SECONDS
    # Lean (CI): only this lane uses the venv; the next version's needs the disk.
    [ "${MASKCACHE_CI_LEAN:-0}" = 1 ] && trap 'rm -rf "$venv"' EXIT
    bash scripts/setup.sh "$venv" "outlines==$version"
    case "$version" in
        # outlines 0.1.x pins numpy < 2; datasets 5 needs a pyarrow built for numpy 2.
        0.1.*) extras=("datasets==3.6.0" "pyarrow==18.1.0") ;;
        *) extras=("datasets==5.2.0") ;;
    esac
    "$venv/bin/python" -m pip --disable-pip-version-check -q install "${extras[@]}"
    if "$venv/bin/python" -m pytest -q tests --ignore=tests/engines \
            --junitxml="$reports/legacy-outlines-$version.xml"; then
        echo "legacy lane: outlines $version passed in $((SECONDS - start)) s"
    else
        echo "legacy lane: outlines $version FAILED after $((SECONDS - start)) s"
        failed+=("$version")
    fi
    [ "${MASKCACHE_CI_LEAN:-0}" = 1 ] && rm -rf "$venv"
done
if [ "${#failed[@]}" -gt 0 ]; then
    echo "legacy lane: failed on outlines ${failed[*]}" >&2
    exit 1
fi
