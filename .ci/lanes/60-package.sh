#!/usr/bin/env bash
# The built package as a user gets it: sdist + wheel (python -m build),
# twine check, then the wheel alone (not editable) in a clean venv: import,
# entry points, `outlines-maskcache status`.
set -euo pipefail
cd "$(dirname "$0")/../.."
reports="${MASKCACHE_REPORTS:-.ci/out}"; mkdir -p "$reports"
tools="$PWD/.venv-package-tools"; clean="$PWD/.venv-package-clean"; dist="$reports/dist"
[ "${MASKCACHE_CI_LEAN:-0}" = 1 ] && trap 'rm -rf "$tools" "$clean"' EXIT
rm -rf "$dist" "$clean"
[ -x "$tools/bin/python" ] || python3 -m venv "$tools"
"$tools/bin/python" -m pip --disable-pip-version-check -q install -U pip "build>=1.2" "twine>=5"
"$tools/bin/python" -m build --outdir "$dist" . >"$reports/package-build.log" 2>&1 || { tail -n 30 "$reports/package-build.log"; exit 1; }
if grep -q "SetuptoolsDeprecationWarning" "$reports/package-build.log"; then
    grep -A3 "SetuptoolsDeprecationWarning" "$reports/package-build.log"; echo "package lane: the build warns of a deprecation"; exit 1
fi
"$tools/bin/twine" check --strict "$dist"/*
python3 -m venv "$clean"
# torch is not a dependency: the clean venv must not resolve one.
"$clean/bin/python" -m pip --disable-pip-version-check -q install "$dist"/*.whl
cd "$reports"  # away from the source tree, so the import is the installed wheel's
"$clean/bin/python" - <<'PY'
import importlib.metadata as m
import outlines_maskcache as mc
assert "site-packages" in mc.__file__, mc.__file__
points = {(e.group, e.value) for e in m.distribution("outlines-maskcache").entry_points}
expected = {("console_scripts", "outlines_maskcache.cli:main"), ("vllm.general_plugins", "outlines_maskcache.plugins:vllm"),
            ("sglang.srt.plugins", "outlines_maskcache.plugins:sglang")}
assert expected <= points, points
print("package lane: wheel", mc.__version__, "imports from", mc.__file__, "entry points", sorted(points))
PY
"$clean/bin/outlines-maskcache" status
echo "package lane: passed"
