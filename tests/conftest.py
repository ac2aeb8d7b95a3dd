"""Hypothesis profiles and shared fixtures.

``HYPOTHESIS_PROFILE=ci`` (default) keeps the suite within the CI budget;
``HYPOTHESIS_PROFILE=nightly`` runs many more examples and longer soaks.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).resolve().parent))

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
settings.register_profile("ci", max_examples=40, derandomize=False, print_blob=True, **_common)
settings.register_profile("nightly", max_examples=600, print_blob=True, **_common)
settings.register_profile("dev", max_examples=10, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def nightly() -> bool:
    return os.environ.get("HYPOTHESIS_PROFILE") == "nightly"


@pytest.fixture(autouse=True)
def _fresh_cache():
    """Every test starts with the cache installed, empty and with default settings."""
    import outlines_maskcache as mc
    from outlines_maskcache.config import Settings

    mc.install()
    mc.clear()
    mc.reset_stats()
    mc.configure(**dataclasses.asdict(Settings()))
    yield
    mc.install()
