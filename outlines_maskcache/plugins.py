"""Entry points that serving engines call in every process they start (vLLM's EngineCore, SGLang's scheduler).

``pyproject.toml`` points ``vllm.general_plugins`` and
``sglang.srt.plugins`` here.  Engines call plugins in each process, more
than once in some (vLLM re-runs them after a fork, and its docs ask that
plugins be re-entrant): :func:`outlines_maskcache.patching.install` is
idempotent, so a second call patches nothing twice.  Both fail soft, like
sentry-sdk's automatic integrations: the engine must start even with a
layout we do not know, so every problem is a log line and the engine runs
stock.
"""

from __future__ import annotations

import logging
import os

from outlines_maskcache import stats_file
from outlines_maskcache.config import enabled_from_env

log = logging.getLogger("outlines_maskcache")


def vllm() -> None:
    """vLLM's ``vllm.general_plugins`` entry point: patch the outlines backend of this process."""
    engine_plugin("vllm-v1", "vLLM")


def sglang() -> None:
    """SGLang's ``sglang.srt.plugins`` entry point: patch the outlines grammar backend of this process."""
    engine_plugin("sglang", "SGLang")


def engine_plugin(target: str, engine: str) -> bool:
    """Install *target* in this process, failing soft; return whether it is patched."""
    if not enabled_from_env():
        log.info("outlines_maskcache: OUTLINES_MASKCACHE is off; %s runs stock", engine)
        return False
    try:
        from outlines_maskcache.patching import install

        installed = install(targets=[target])
    except Exception as err:  # noqa: BLE001 - an unknown layout must not stop the engine
        log.warning("outlines_maskcache: not patching %s (%s: %s); it runs stock", engine, type(err).__name__, err)
        return False
    if target not in installed:
        return False
    stats_file.register_at_exit()
    log.info("outlines_maskcache: %s patched in pid %d", engine, os.getpid())
    return True
