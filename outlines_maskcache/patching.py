"""Applying and removing the targets' patches, reversibly.

Modelled on OpenTelemetry's instrumentors: each :class:`Target` names the
distribution and version range it supports as data; its adapter receives
the imported module and the installed version and returns the patches.  A target is applied whole or not at all, and
``uninstall`` puts back the exact objects found in each owner's ``__dict__``
(a staticmethod stays a staticmethod; an inherited attribute is deleted again).

Like sentry-sdk's integrations, automatic installs fail soft (a warning, stock
outlines keeps running) and explicit ``install(strict=True)`` fails loudly.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any

from outlines_maskcache.contract import Patch, Target, UnknownLayout, UnsupportedVersionError
from outlines_maskcache.runtime import RUNTIME
from outlines_maskcache.versions import is_tested

log = logging.getLogger("outlines_maskcache")

__all__ = ["Patch", "Target", "UnsupportedVersionError", "install", "installed_targets", "is_installed", "uninstall"]

_MISSING = object()


@dataclass
class _Applied:
    patch: Patch
    original: Any


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
        patches = target.patches_function()(module, version)
    except Exception as err:  # noqa: BLE001 - a missing attribute or an UnknownLayout: a layout we do not know
        why = str(err) if isinstance(err, UnknownLayout) else repr(err)
        _complain(f"outlines_maskcache: cannot patch {target.name!r} on {target.distributions[0]} {version}: {why}", strict)
        return
    applied: list[_Applied] = []
    try:
        for patch in patches:
            original = patch.owner.__dict__.get(patch.name, _MISSING)
            setattr(patch.owner, patch.name, patch.replacement)
            applied.append(_Applied(patch, original))
    except Exception as err:  # noqa: BLE001 - a target is applied whole or not at all
        _restore(applied)
        _complain(f"outlines_maskcache: cannot patch {target.name!r}: {err!r}", strict)
        return
    _applied[target.name] = applied
    if not is_tested(target.name, version):
        log.info("outlines_maskcache: %s %s is inside the range of target %r (%s) but not in the tested matrix "
                 "(docs/versions.md)", target.distributions[0], version, target.name, target.supported)


def uninstall() -> None:
    """Restore every patched attribute to the exact object it was before.

    Full compiles still running behind lazy Indexes finish first, so every
    processor holds outlines_core's own Index afterwards.
    """
    RUNTIME.settle()
    with _lock:
        for name in list(_applied):
            _restore(_applied.pop(name))
        RUNTIME.installed = False


def _restore(applied: list[_Applied]) -> None:
    """Put back what each patch replaced, newest first."""
    for item in reversed(applied):
        owner, attr = item.patch.owner, item.patch.name
        if owner.__dict__.get(attr, _MISSING) is not item.patch.replacement:
            warnings.warn(
                f"outlines_maskcache: {getattr(owner, '__qualname__', getattr(owner, '__name__', owner))}.{attr} "
                "was re-patched by someone else; "
                "leaving it (our wrapper delegates to stock when uninstalled)",
                RuntimeWarning,
                stacklevel=4,
            )
            continue
        if item.original is _MISSING:
            delattr(owner, attr)
        else:
            setattr(owner, attr, item.original)


def is_installed() -> bool:
    return RUNTIME.installed


def installed_targets() -> list[str]:
    with _lock:
        return sorted(_applied)


def original(owner: Any, name: str) -> Any:
    """What *owner.name* was before our patch (the attribute itself when it is not patched).

    For code of ours that needs stock's behaviour whatever is installed
    (ahead-of-time compiles must name the very vocabulary stock converts).
    """
    with _lock:
        for applied in _applied.values():
            for item in applied:
                if item.patch.owner is owner and item.patch.name == name and item.original is not _MISSING:
                    return item.original
    return owner.__dict__.get(name, getattr(owner, name))

