"""outlines-maskcache: per-FSM-state mask caching for outlines.

``import outlines_maskcache`` patches every supported outlines code path
present (set ``OUTLINES_MASKCACHE=0`` to only import).  Outputs stay
bit-identical to stock outlines; see docs/design.md for why.
"""

from __future__ import annotations

import os
from typing import Any

from outlines_maskcache.config import ConfigError, Settings, enabled_from_env
from outlines_maskcache.contract import UnsupportedVersionError
from outlines_maskcache.patching import install, installed_targets, is_installed, uninstall
from outlines_maskcache.runtime import RUNTIME, disabled

__version__ = "0.2.0"

__all__ = [
    "ConfigError",
    "UnsupportedVersionError",
    "clear",
    "configure",
    "precompile",
    "disabled",
    "install",
    "installed_targets",
    "is_installed",
    "reset_stats",
    "settings",
    "stats",
    "uninstall",
]


def stats() -> dict[str, Any]:
    """What the cache did: hits, misses, evictions, entries, bytes, fallbacks..."""
    return RUNTIME.stats()


def reset_stats() -> None:
    RUNTIME.reset_stats()


def clear() -> None:
    """Drop every cached mask, memoized grammar and plan in this process (counters and the store are kept)."""
    RUNTIME.clear()


_UNSET: Any = object()


def configure(
    *,
    max_bytes: int | None = None,
    max_grammars: int | None = None,
    form: str | None = None,
    nan_guard: bool | None = None,
    verify: bool | None = None,
    sparse_below: float | None = None,
    store: "str | os.PathLike[str] | bool | None" = _UNSET,
    store_max_bytes: int | None = None,
    compile_timeout: float | None = _UNSET,
    compile_max_bytes: int | None = _UNSET,
    quiet_advance: bool | None = None,
    plan_sparse_rows: bool | None = None,
    lazy_index: bool | None = _UNSET,
) -> Settings:
    """Change settings; invalid values raise :class:`ConfigError` and change nothing.

    max_bytes: cached mask bytes allowed per device (LRU eviction past it).
    max_grammars: compiled grammars (Index objects) kept for reuse.
    form: ``auto`` | ``bound`` | ``blocked`` (see docs/design.md).
    nan_guard: repair NaN logits on blocked tokens exactly as stock does (costs a pass).
    verify: compare every served mask with a fresh build (debugging; slow).
    sparse_below: states allowing at most this fraction of the vocabulary are
        cached as token ids (CPU); 0 keeps every state as a dense row.
    store: directory of the persistent grammar store, ``"auto"`` (the user
        cache directory) or ``False``/``None`` (off); see docs/store.md.
    store_max_bytes: bytes of compiled grammars kept on disk (LRU beyond it).
    compile_timeout / compile_max_bytes: compile new grammars in a child
        process killed past this many seconds / bytes of memory (``None``:
        in process and unbounded, as stock); with outlines 1.2-1.3 the JSON
        schema -> regex conversion runs there too, since for some real
        schemas it alone exhausts memory.
    quiet_advance / plan_sparse_rows: engine-side work
        beyond the mask cache (docs/engines.md); on by default.
    lazy_index: serve a never-seen regex's first masks from a lazy Index
        while the full Index compiles off the decode path (docs/lazy-index.md);
        ``None`` (default): on where CI proves the installed outlines_core.
    """
    changes: dict[str, Any] = {
        k: v
        for k, v in dict(max_bytes=max_bytes, max_grammars=max_grammars, form=form, nan_guard=nan_guard, verify=verify,
             sparse_below=sparse_below, store_max_bytes=store_max_bytes, quiet_advance=quiet_advance,
             plan_sparse_rows=plan_sparse_rows).items()
        if v is not None
    }
    if store is not _UNSET:
        changes["store"] = None if store is None or store is False else store
    for name, value in (("compile_timeout", compile_timeout), ("compile_max_bytes", compile_max_bytes),
                        ("lazy_index", lazy_index)):
        if value is not _UNSET:
            changes[name] = value
    return RUNTIME.configure(**changes)


def precompile(tokenizer: Any, schemas: Any, **options: Any) -> Any:
    """Compile *schemas* for a Hugging Face *tokenizer* into the grammar store (see :mod:`outlines_maskcache.ahead_of_time`)."""
    from outlines_maskcache.ahead_of_time import precompile as run

    return run(tokenizer, schemas, **options)


def settings() -> Settings:
    return RUNTIME.settings


if enabled_from_env():
    install()
