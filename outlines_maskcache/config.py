"""Settings of the cache and how they are read from the environment.

Environment values are parsed strictly: a value we do not understand is a
warning and the safe default, never a guess.  The safe default for the master
switch is *stock outlines*, because a deployment that wrote
``OUTLINES_MASKCACHE=maybe`` has not asked for a changed code path.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass, replace
from typing import Mapping

from outlines_maskcache.row_forms import SPARSE_BELOW

ENV_ENABLE = "OUTLINES_MASKCACHE"
ENV_MAX_BYTES = "OUTLINES_MASKCACHE_MAX_BYTES"
ENV_STORE = "OUTLINES_MASKCACHE_STORE"
ENV_STORE_MAX_BYTES = "OUTLINES_MASKCACHE_STORE_MAX_BYTES"
#: on/off settings read from the environment once, at import: engine-side work beyond the mask
#: cache (docs/engines.md) and the lazy Index (docs/lazy-index.md); unset keeps the default
ENV_SWITCHES = {
    "quiet_advance": "OUTLINES_MASKCACHE_QUIET_ADVANCE",
    "plan_sparse_rows": "OUTLINES_MASKCACHE_SPARSE_APPLY",
    "lazy_index": "OUTLINES_MASKCACHE_LAZY_INDEX",
}

#: Bytes of cached masks allowed per device.  A 128k-vocabulary fp32 row is
#: 512 KiB, so the default holds about 2,000 states per device.
DEFAULT_MAX_BYTES = 1 << 30
DEFAULT_MAX_GRAMMARS = 64
#: ``auto`` picks the fastest exact form for the logits' device: ``bound``
#: (a +inf/-inf row applied with one ``minimum``) on CPU, ``blocked`` (a bool
#: row applied with ``masked_fill_``) on accelerators.
FORMS = ("auto", "bound", "blocked")
#: A state allowing at most this fraction of the vocabulary is cached as the
#: ids of its allowed tokens instead of a dense row (CPU): at 128k tokens,
#: up to 2,004 ids (16 KiB) instead of a 512 KiB row, and applied by moving
#: those values rather than combining a whole row.  Numbers, keys and
#: punctuation of a JSON schema are such states; free text is not.
DEFAULT_SPARSE_BELOW = SPARSE_BELOW
#: ``store="auto"``: the platform's user cache directory (see ``store.default_root``)
STORE_AUTO = "auto"
#: Bytes of compiled grammars kept on disk; an Index for a JSON schema at
#: 128k tokens is 1-50 MB, so this holds a few hundred schemas.
DEFAULT_STORE_MAX_BYTES = 2 << 30

_TRUE = {"1", "true", "yes", "on"}
FALSE_WORDS = {"0", "false", "no", "off"}
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]i?)?b?\s*$", re.IGNORECASE)


class ConfigError(ValueError):
    """A setting that cannot be honoured; raised before anything changes."""


@dataclass(frozen=True)
class Settings:
    """One immutable snapshot, swapped whole so readers never see a half update."""

    max_bytes: int = DEFAULT_MAX_BYTES
    max_grammars: int = DEFAULT_MAX_GRAMMARS
    form: str = "auto"
    nan_guard: bool = False
    verify: bool = False
    sparse_below: float = DEFAULT_SPARSE_BELOW
    #: directory of the persistent grammar store; ``auto`` = user cache dir; None = off
    store: str | None = STORE_AUTO
    store_max_bytes: int = DEFAULT_STORE_MAX_BYTES
    #: engines: skip building the token list a caller of ``Guide.advance`` discards
    quiet_advance: bool = True
    #: engines applying int32 bitmasks on CPU: plan rows that allow few tokens
    plan_sparse_rows: bool = True
    #: serve a never-seen regex from a lazy Index while the full one compiles behind it:
    #: None = on where CI proves the outlines_core release (versions.LAZY_INDEX_PROVEN), or True/False
    lazy_index: bool | None = None
    #: inline compiles in a guarded child process (None = in process, as stock)
    compile_timeout: float | None = None
    compile_max_bytes: int | None = None

    def updated(self, **changes: object) -> "Settings":
        for name, value in changes.items():
            _validate(name, value)
        if isinstance(changes.get("store"), os.PathLike):
            changes["store"] = os.fspath(changes["store"])
        return replace(self, **changes)  # type: ignore[arg-type]


def _validate(name: str, value: object) -> None:
    if name in ("max_bytes", "max_grammars", "store_max_bytes"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if value < 0 or (name == "max_grammars" and value == 0):
            raise ConfigError(f"{name} must be {'>= 1' if name == 'max_grammars' else '>= 0'}, got {value}")
    elif name == "form":
        if value not in FORMS:
            raise ConfigError(f"form must be one of {FORMS}, got {value!r}")
    elif name == "sparse_below":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ConfigError(f"sparse_below must be a number in [0, 1], got {value!r}")
    elif name == "store":
        if value is not None and (not isinstance(value, (str, os.PathLike)) or not str(value).strip()):
            raise ConfigError(f"store must be a directory path, 'auto' or None (off), got {value!r}")
    elif name == "compile_timeout":
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise ConfigError(f"compile_timeout must be None or a number of seconds > 0, got {value!r}")
    elif name == "compile_max_bytes":
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 64 << 20):
            raise ConfigError(f"compile_max_bytes must be None or an int >= 64 MiB, got {value!r}")
    elif name == "lazy_index":
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"lazy_index must be None (auto), True or False, got {value!r}")
    elif name in ("nan_guard", "verify", *ENV_SWITCHES):
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be a bool, got {value!r}")
    else:
        raise ConfigError(f"unknown setting {name!r}")


def size_argument(text: str) -> int:
    """:func:`parse_size` for argparse: a bad size is a usage error, not a traceback."""
    import argparse

    try:
        return parse_size(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def parse_size(text: str) -> int:
    """Read ``"536870912"``, ``"512MiB"`` or ``"1G"`` as a byte count."""
    match = _SIZE.match(text)
    if not match:
        raise ConfigError(f"not a byte size: {text!r} (use e.g. 536870912, 512MiB, 1G)")
    return int(match.group(1)) * _UNITS[(match.group(2) or "").lower()]


def _switch(raw: str | None) -> bool | None:
    """An on/off environment value: True, False, None when unset or empty; ValueError for anything else."""
    if raw is None or not raw.strip():
        return None
    value = raw.strip().lower()
    if value in _TRUE | FALSE_WORDS:
        return value in _TRUE
    raise ValueError(f"{raw!r} is not one of {sorted(_TRUE | FALSE_WORDS)}")


def enabled_from_env(environ: Mapping[str, str] = os.environ) -> bool:
    try:
        switch = _switch(environ.get(ENV_ENABLE))
    except ValueError as err:
        warnings.warn(f"{ENV_ENABLE}={err}; outlines_maskcache stays off and outlines runs stock",
                      RuntimeWarning, stacklevel=3)
        return False
    return switch is not False


def settings_from_env(environ: Mapping[str, str] = os.environ) -> Settings:
    settings = Settings()
    for env, name, default in ((ENV_MAX_BYTES, "max_bytes", DEFAULT_MAX_BYTES),
                               (ENV_STORE_MAX_BYTES, "store_max_bytes", DEFAULT_STORE_MAX_BYTES)):
        raw = environ.get(env)
        if raw is not None and raw.strip():
            try:
                settings = settings.updated(**{name: parse_size(raw)})
            except ConfigError as err:
                warnings.warn(f"{env}: {err}; keeping the default of {default} bytes", RuntimeWarning, stacklevel=3)
    for name, env in ENV_SWITCHES.items():
        try:
            switch = _switch(environ.get(env))
        except ValueError as err:
            warnings.warn(f"{env}={err}; keeping the default", RuntimeWarning, stacklevel=3)
            continue
        if switch is not None:
            settings = settings.updated(**{name: switch})
    raw = environ.get(ENV_STORE)
    if raw is not None and raw.strip():
        value = raw.strip()
        # "0"/"off" turns the store off; any other value is a directory.
        settings = settings.updated(store=None if value.lower() in FALSE_WORDS else value)
    return settings
