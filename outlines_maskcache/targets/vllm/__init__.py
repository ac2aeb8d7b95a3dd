"""Adapter for vLLM V1: ``vllm.v1.structured_output.backend_outlines``.

vLLM's outlines backend fills one int32 bitmask row per constrained
request per step (``guide.write_mask_into``) in the EngineCore process and
applies the bitmask to the logits.  :mod:`.compile` names each grammar by
its content, loads Indexes from the store and wraps guides in a
:mod:`.quiet_guide`; :mod:`.fill` serves rows from the cache; :mod:`.apply`
applies sparse CPU rows by plans.  A grammar compiled while the cache was
off carries no fingerprint and is filled by stock.

Loaded by the ``vllm.general_plugins`` entry point in every process
(:func:`outlines_maskcache.plugins.vllm`); the EngineCore's stats reach
the user through ``OUTLINES_MASKCACHE_STATS_FILE``.
"""

from __future__ import annotations

import logging
import sys
from types import ModuleType

from packaging.version import Version

from outlines_maskcache.contract import Patch, UnknownLayout

log = logging.getLogger("outlines_maskcache")


def patches(module: ModuleType, version: Version) -> list[Patch]:
    from outlines_maskcache.targets.vllm import apply, compile, fill

    backend_cls = getattr(module, "OutlinesBackend", None)
    grammar_cls = getattr(module, "OutlinesGrammar", None)
    if backend_cls is None or grammar_cls is None or "compile_grammar" not in backend_cls.__dict__ \
            or "fill_bitmask" not in grammar_cls.__dict__:
        raise UnknownLayout("vLLM's outlines backend has no OutlinesBackend.compile_grammar / OutlinesGrammar.fill_bitmask")
    found = compile.patches(module, backend_cls, str(version)) + fill.patches(grammar_cls, backend_cls)
    utils = sys.modules.get(module.__name__.rpartition(".")[0] + ".utils")
    # Only the planned apply depends on it: utils.apply_grammar_bitmask calling xgr (vLLM 0.34 moved the
    # CPU apply into its CPU worker, and keeps xgr for other uses: a stand-in there would never be called).
    if utils is not None and "xgr" in vars(utils) and "apply_grammar_bitmask" in vars(utils):
        found.append(Patch(utils, "xgr", apply.XgrammarStandIn(vars(utils)["xgr"])))
    else:
        from outlines_maskcache.targets import target

        said = "; ".join(target("vllm-v1").caveats_for(version)) or \
            "masks and Indexes are cached; the bitmask apply is vLLM's own"
        log.warning("outlines_maskcache: vLLM %s has no utils.apply_grammar_bitmask calling xgr: %s "
                    "(docs/engines.md)", version, said)
    return found
