"""Adapters for fake targets over the ``json`` module (the registry names adapters by import string)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from outlines_maskcache.contract import Patch, UnknownLayout

#: what the last adapter call received: (module, version)
received: list[tuple[ModuleType, Any]] = []


def probe(module: ModuleType, version: Any) -> list[Patch]:
    received.append((module, version))
    return [Patch(module, "maskcache_probe", 1)]


def broken(module: ModuleType, version: Any) -> list[Patch]:
    return [Patch(module, "loads", module.no_such_attribute)]


def unknown_layout(module: ModuleType, version: Any) -> list[Patch]:
    raise UnknownLayout("json has no signature we know")


def half_applicable(module: ModuleType, version: Any) -> list[Patch]:
    """A first patch that applies and a second whose owner refuses it: the first must be undone."""
    return [Patch(module, "maskcache_probe", 1), Patch(int, "maskcache_probe", 2)]
