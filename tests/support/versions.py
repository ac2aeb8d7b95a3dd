"""Which outlines line is installed, and skip markers for tests that need one."""

from __future__ import annotations

import importlib.metadata

import pytest
from packaging.version import Version


def outlines_version() -> Version:
    return Version(importlib.metadata.version("outlines"))


requires_outlines_core_backend = pytest.mark.skipif(
    outlines_version() < Version("1.2"), reason="the outlines_core backend processor exists from outlines 1.2"
)


def on_guide_processor_line() -> bool:
    """outlines 0.1.1-1.1.x: masks come from ``GuideLogitsProcessor`` over a Python ``RegexGuide``."""
    return Version("0.1.1") <= Version(outlines_version().base_version) < Version("1.2")


def tensor_adapter_layout() -> bool:
    """outlines 1.0-1.1: processors take a ``tensor_library_name`` and mask out of place."""
    return outlines_version() >= Version("1.0")


requires_guide_processor = pytest.mark.skipif(
    not on_guide_processor_line(),
    reason="GuideLogitsProcessor over a Python RegexGuide is the outlines 0.1.1-1.1.x code path",
)
