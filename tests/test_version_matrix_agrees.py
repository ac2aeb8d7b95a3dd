"""The tested matrix is written once (outlines_maskcache/versions.py); the ranges and the docs agree with it."""

from __future__ import annotations

import re
from pathlib import Path

from packaging.version import Version

from outlines_maskcache.targets import TARGETS
from outlines_maskcache.versions import TESTED, is_tested

DOCS = Path(__file__).resolve().parent.parent / "docs" / "versions.md"


def test_every_target_has_tested_releases():
    assert {t.name for t in TARGETS} == set(TESTED)


def test_each_range_is_bounded_by_its_oldest_and_newest_tested_release():
    for target in TARGETS:
        tested = [Version(v) for v in TESTED[target.name]]
        assert tested == sorted(tested), target.name
        assert all(target.supports(v) for v in tested), target.name
        for spec in target._spec:
            if spec.operator == ">=":
                assert Version(spec.version) == tested[0], (target.name, str(spec))
            elif spec.operator == "<=":
                assert Version(spec.version) == tested[-1], (target.name, str(spec))
            elif spec.operator == "==":
                prefix = spec.version.removesuffix(".*")
                assert all(str(v).startswith(prefix) for v in tested), (target.name, str(spec))
            else:  # an open bound would claim releases CI never ran
                raise AssertionError(f"{target.name}: {spec} is not a bound at a tested release")


def test_docs_table_lists_each_tested_release():
    text = DOCS.read_text(encoding="utf-8")
    for target in TARGETS:
        row = next((line for line in text.splitlines() if line.startswith(f"| `{target.name}`")), None)
        assert row is not None, f"docs/versions.md has no row for {target.name}"
        assert target.supported in row, (target.name, target.supported)
        listed = set(re.findall(r"\d+\.\d+\.\d+", row.split("|")[3]))
        assert listed == set(TESTED[target.name]), (target.name, listed)


def test_untested_release_is_recognised():
    assert is_tested("outlines-core-backend", "1.3.3") and is_tested("vllm-v1", "0.32.0+cpu")
    assert not is_tested("outlines-core-backend", "1.2.1")


def test_oldest_python_session_is_the_oldest_python_claimed():
    from outlines_maskcache.versions import PYTHONS

    pyproject = (DOCS.parent.parent / "pyproject.toml").read_text(encoding="utf-8")
    claimed = re.search(r'^requires-python = ">=(\d+\.\d+)"', pyproject, re.MULTILINE).group(1)
    assert min(Version(v) for v in PYTHONS).release[:2] == Version(claimed).release[:2]
    text = DOCS.read_text(encoding="utf-8")
    assert all(v in text for v in PYTHONS), "docs/versions.md names every Python session"


def test_releases_run_without_dependencies_are_tested_releases_and_the_docs_say_how():
    from outlines_maskcache.versions import WITHOUT_DEPENDENCIES

    text = DOCS.read_text(encoding="utf-8")
    for name, releases in WITHOUT_DEPENDENCIES.items():
        assert set(releases) <= set(TESTED[name]), name
        row = next(line for line in text.splitlines() if line.startswith(f"| `{name}`"))
        assert all(f"{r} (without its dependencies" in row for r in releases), (name, row)


def test_caveats_apply_by_version_and_are_documented():
    from outlines_maskcache.targets import target

    vllm = target("vllm-v1")
    assert vllm.caveats_for(Version("0.32.0+cpu")) == []
    assert any("apply is vLLM's own" in c for c in vllm.caveats_for(Version("0.34.0")))
    text = DOCS.read_text(encoding="utf-8")
    assert "the bitmask apply is vLLM's own" in text
