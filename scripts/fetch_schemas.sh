#!/usr/bin/env bash
# Real JSON Schemas no one here wrote, from PyPI packages (no other network):
#  - the JSON-Schema-Test-Suite inside jsonschema's source archive
#  - SchemaStore schemas vendored in the check-jsonschema wheel
# Unpacked under .cache/schemas/ (kept between runs on one machine).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.cache/schemas
py="${PYTHON:-.venv/bin/python}"
# Downloads are kept machine-wide so a fresh clone on the same machine does not
# rebuild jsonschema's sdist metadata again (~1 min).
dl="${MASKCACHE_DOWNLOADS:-$HOME/.cache/outlines-maskcache/dl}"
mkdir -p "$dest" "$dl"
[ -d "$dest/json-schema-test-suite" ] || {
  [ -f "$dl/jsonschema-4.26.0.tar.gz" ] ||
    "$py" -m pip download -q --disable-pip-version-check --no-binary :all: --no-deps jsonschema==4.26.0 -d "$dl"
  tmp=$(mktemp -d); tar -xzf "$dl/jsonschema-4.26.0.tar.gz" -C "$tmp"
  mv "$tmp"/jsonschema-4.26.0/json/tests "$dest/json-schema-test-suite"; rm -rf "$tmp"
}
[ -d "$dest/schemastore" ] || {
  ls "$dl"/check_jsonschema-0.39.0-*.whl >/dev/null 2>&1 ||
    "$py" -m pip download -q --disable-pip-version-check --no-deps check-jsonschema==0.39.0 -d "$dl"
  tmp=$(mktemp -d); "$py" -m zipfile -e "$dl"/check_jsonschema-0.39.0-*.whl "$tmp"
  mv "$tmp"/check_jsonschema/builtin_schemas/vendor "$dest/schemastore"; rm -rf "$tmp"
}
echo "schemas: $(find "$dest/json-schema-test-suite" -name '*.json' | wc -l) test-suite files, $(ls "$dest/schemastore" | wc -l) schemastore files"
