"""The install contract between the patcher and its adapters: what a patch is, what a target is, the errors.

A leaf module: it imports nothing of this package, so adapters, the
patcher, the plugins and the CLI can all depend on it without forming a
circle.  In the manner of OpenTelemetry's instrumentors and sentry-sdk's
integrations, a :class:`Target` is data: the distribution whose version
decides, the versions it supports, the module it patches and the import
string of the adapter function that returns the patches.  The adapter is
imported only when its target is applied, and it receives the installed
version, so behaviour that changed between releases is a parameter of the
adapter, never a guess.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version


class UnsupportedVersionError(RuntimeError):
    """Raised by ``install(strict=True)`` when a target cannot be patched."""


class UnknownLayout(RuntimeError):
    """An adapter found a signature or shape it was not written for; its target stays stock."""


@dataclass(frozen=True)
class Patch:
    """Set ``owner.name = replacement`` on install; uninstall puts back exactly what ``owner.__dict__`` held."""

    owner: Any
    name: str
    replacement: Any


#: ``patches(module, version)``: the adapter's patches for the imported module at the installed version
PatchesFunction = Callable[[ModuleType, Version], "list[Patch]"]


@dataclass(frozen=True)
class Target:
    #: short name reported by ``install()`` and ``status``
    name: str
    #: distribution(s) whose version decides; the first one installed counts
    distributions: tuple[str, ...]
    #: versions this target is written for (the tested releases are in :mod:`outlines_maskcache.versions`)
    supported: str
    #: the module whose attributes are patched
    module: str
    #: ``"package.module:function"``, a :data:`PatchesFunction`, imported on apply
    adapter: str
    #: patched by ``import outlines_maskcache``; False for engines too heavy to
    #: import eagerly (they load us themselves through their plugin entry points)
    automatic: bool = True
    note: str = ""
    #: (version specifier, what differs there): parts of the target a release in range does not get,
    #: said by ``status`` and by the adapter's install warning
    caveats: tuple[tuple[str, str], ...] = ()
    _spec: SpecifierSet = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_spec", SpecifierSet(self.supported))

    def installed(self) -> tuple[str, Version | None] | None:
        """(distribution, version) of the first of ours that is installed; version None if unreadable."""
        for dist in self.distributions:
            try:
                raw = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
            try:
                return dist, Version(raw)
            except InvalidVersion:
                return dist, None
        return None

    def installed_version(self) -> Version | None:
        found = self.installed()
        return found[1] if found else None

    def caveats_for(self, version: Version) -> list[str]:
        """The caveats whose specifier holds *version* (its local label ignored)."""
        base = Version(version.base_version)
        return [text for spec, text in self.caveats if base in SpecifierSet(spec)]

    def supports(self, version: Version) -> bool:
        # Local labels (+cpu) and dev builds of a supported release count.
        return Version(version.base_version) in self._spec

    def patches_function(self) -> PatchesFunction:
        module_name, _, attribute = self.adapter.partition(":")
        return getattr(importlib.import_module(module_name), attribute)
