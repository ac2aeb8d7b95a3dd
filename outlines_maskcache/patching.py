"""Reversible patches and the table of what may be patched.

Modelled on OpenTelemetry's instrumentors: each :class:`Target` names the
distribution and version range it supports as data, imports its module and
returns the patches to apply.  A target is applied whole or not at all, and
``uninstall`` puts back the exact objects found in each owner's ``__dict__``
(a staticmethod stays a staticmethod; an inherited attribute is deleted again).

Like sentry-sdk's integrations, automatic installs fail soft (a warning, stock
outlines keeps running) and explicit ``install(strict=True)`` fails loudly.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import threading
import warnings
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from outlines_maskcache.runtime import RUNTIME

_MISSING = object()


class UnsupportedVersionError(RuntimeError):
    """Raised by ``install(strict=True)`` when a target cannot be patched."""


@dataclass(frozen=True)
class Patch:
    owner: Any
    name: str
    replacement: Any


@dataclass
class _Applied:
    patch: Patch
    original: Any


@dataclass(frozen=True)
class Target:
    #: short name reported by ``install()``
    name: str
    #: distribution(s) whose version decides; the first one installed counts
    distributions: tuple[str, ...]
    #: versions this target is written and tested for
    supported: str
    module: str
    patches: Callable[[ModuleType], list[Patch]]
    #: patched by ``import outlines_maskcache``; False for engines too heavy to
    #: import eagerly (vLLM loads us itself through its plugin entry point)
    automatic: bool = True
    note: str = ""
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

    def supports(self, version: Version) -> bool:
        # Local labels (+cpu) and dev builds of a supported release count.
        return Version(version.base_version) in self._spec


_lock = threading.RLock()
_applied: dict[str, list[_Applied]] = {}


def _targets() -> list[Target]:
    from outlines_maskcache.targets import TARGETS

    return TARGETS


def _complain(message: str, strict: bool) -> None:
    if strict:
        raise UnsupportedVersionError(message)
    warnings.warn(message + "; outlines runs stock", RuntimeWarning, stacklevel=4)


def install(strict: bool = False, targets: list[str] | None = None) -> list[str]:
    """Patch every supported target present (or those named); return what is patched.

    Idempotent.  With ``strict=True`` a named or present-but-unsupported
    target raises :class:`UnsupportedVersionError` instead of warning.
    """
    with _lock:
        known = {t.name: t for t in _targets()}
        if targets is not None:
            unknown = sorted(set(targets) - set(known))
            if unknown:
                raise ValueError(f"unknown targets {unknown}; known: {sorted(known)}")
        for target in known.values():
            explicit = targets is not None and target.name in targets
            if target.name in _applied or (targets is not None and not explicit):
                continue
            if targets is None and not target.automatic and target.module.split(".")[0] not in sys.modules:
                continue
            _try_apply(target, strict=strict or explicit, explicit=explicit)
        RUNTIME.installed = bool(_applied)
        return sorted(_applied)


def _try_apply(target: Target, strict: bool, explicit: bool) -> None:
    version = target.installed_version()
    if version is None:
        if explicit:
            _complain(f"outlines_maskcache: target {target.name!r} needs {target.distributions[0]}, which is not installed", strict)
        return
    if not target.supports(version):
        # Another target may cover this version (the outlines lines); only
        # complain when none does.
        if explicit or not any(
            t.supports(version) for t in _targets() if t.distributions == target.distributions
        ):
            _complain(
                f"outlines_maskcache: {target.distributions[0]} {version} is outside the supported "
                f"range of target {target.name!r} ({target.supported})",
                strict,
            )
        return
    try:
        module = importlib.import_module(target.module)
        patches = target.patches(module)
    except Exception as err:  # noqa: BLE001 - a missing attribute means a layout we do not know
        _complain(f"outlines_maskcache: cannot patch {target.name!r} on {target.distributions[0]} {version}: {err!r}", strict)
        return
    applied = []
    for patch in patches:
        applied.append(_Applied(patch, patch.owner.__dict__.get(patch.name, _MISSING)))
        setattr(patch.owner, patch.name, patch.replacement)
    _applied[target.name] = applied


def uninstall() -> None:
    """Restore every patched attribute to the exact object it was before."""
    with _lock:
        for name in list(_applied):
            for item in reversed(_applied.pop(name)):
                owner, attr = item.patch.owner, item.patch.name
                if owner.__dict__.get(attr, _MISSING) is not item.patch.replacement:
                    warnings.warn(
                        f"outlines_maskcache: {getattr(owner, '__qualname__', getattr(owner, '__name__', owner))}.{attr} "
                        "was re-patched by someone else; "
                        "leaving it (our wrapper delegates to stock when uninstalled)",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                    continue
                if item.original is _MISSING:
                    delattr(owner, attr)
                else:
                    setattr(owner, attr, item.original)
        RUNTIME.installed = False


def is_installed() -> bool:
    return RUNTIME.installed


def installed_targets() -> list[str]:
    with _lock:
        return sorted(_applied)

