"""The stats file engine processes write (vLLM's EngineCore, SGLang's scheduler); their entry points are in :mod:`outlines_maskcache.plugins`.

Serving engines fill masks in a process the user never holds, where
``outlines_maskcache.stats()`` cannot be called.  With
``OUTLINES_MASKCACHE_STATS_FILE=/path/stats-{pid}.json`` every process that
filled masks writes its stats there (``{pid}`` is replaced), atomically:
when the adapter sees its engine shut down, every few seconds while it
fills (engines may kill their workers without running exit hooks), and at
interpreter exit.
"""

from __future__ import annotations

import json
import logging
import os
import time
from types import SimpleNamespace

from outlines_maskcache.runtime import RUNTIME

log = logging.getLogger("outlines_maskcache")

ENV_STATS_FILE = "OUTLINES_MASKCACHE_STATS_FILE"
#: seconds between periodic writes while a process fills masks
PERIOD = 2.0

_state = {"filled": False, "registered": False, "next": 0.0}


def filled() -> None:
    """Call on every fill (or apply): marks this process as one that reports, and writes when a period has passed."""
    _state["filled"] = True
    now = time.monotonic()
    if now >= _state["next"]:
        _state["next"] = now + PERIOD
        write_safely()


def write() -> None:
    """Write this process's stats to ``$OUTLINES_MASKCACHE_STATS_FILE`` if it filled any mask."""
    template = os.environ.get(ENV_STATS_FILE)
    if not template or not _state["filled"]:
        return
    path = template.replace("{pid}", str(os.getpid()))
    stats = dict(RUNTIME.stats(), pid=os.getpid())
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(stats, fh, default=str)
    os.replace(tmp, path)


def write_safely() -> None:
    try:
        write()
    except OSError as err:
        log.warning("outlines_maskcache: cannot write %s (%s)", ENV_STATS_FILE, err)


def register_at_exit() -> None:
    """For engines that exit without telling the adapter; writing twice is harmless (the newest counts win).

    Through the runtime's exit hook, so the file is written after the
    background work settled and the mask rows were saved, and counts them.
    """
    if _state["registered"] or not os.environ.get(ENV_STATS_FILE):
        return
    _state["registered"] = True
    RUNTIME.own(SimpleNamespace(at_exit=write_safely))
