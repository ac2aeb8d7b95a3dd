"""Checks shared by the engines whose plugin entry point patches their process (vLLM, SGLang)."""

from __future__ import annotations

from typing import Callable

import pytest

import outlines_maskcache as mc


def assert_plugin_respects_master_switch(monkeypatch: pytest.MonkeyPatch, plugin: Callable[[], None],
                                         target: str) -> None:
    """The entry point patches nothing under OUTLINES_MASKCACHE=0, and patches again once it is back on."""
    mc.uninstall()
    monkeypatch.setenv("OUTLINES_MASKCACHE", "0")
    plugin()
    assert target not in mc.installed_targets()
    monkeypatch.setenv("OUTLINES_MASKCACHE", "1")
    plugin()
    assert target in mc.installed_targets()
