"""The vLLM adapter reads the installed layout: where vLLM no longer applies bitmasks through
``utils.apply_grammar_bitmask`` and ``xgr`` (0.34 moved the CPU apply into its CPU worker, yet keeps
``xgr`` for other uses), no stand-in is installed that would never be called, and the log says the
bitmask apply is vLLM's own.  Module doubles, so this runs without vLLM."""

from __future__ import annotations

import logging
import sys
import types

import pytest
from packaging.version import Version

from outlines_maskcache.targets import vllm as vllm_target


def _layout(name: str, with_apply: bool) -> types.ModuleType:
    package = f"{name}.v1.structured_output"
    backend = types.ModuleType(f"{package}.backend_outlines")

    class OutlinesBackend:
        def compile_grammar(self, request_type, grammar_spec):  # pragma: no cover - never called here
            raise AssertionError

    class OutlinesGrammar:
        def fill_bitmask(self, bitmask, idx):  # pragma: no cover - never called here
            raise AssertionError

    backend.OutlinesBackend, backend.OutlinesGrammar = OutlinesBackend, OutlinesGrammar
    utils = types.ModuleType(f"{package}.utils")
    utils.xgr = object()
    if with_apply:
        utils.apply_grammar_bitmask = lambda *args: None
    sys.modules[utils.__name__] = utils
    return backend


@pytest.mark.parametrize("with_apply", [True, False])
def test_the_xgr_stand_in_only_where_vllm_applies_through_it(with_apply, caplog):
    name = f"fake_vllm_{int(with_apply)}"
    backend = _layout(name, with_apply)
    try:
        with caplog.at_level(logging.WARNING, logger="outlines_maskcache"):
            found = vllm_target.patches(backend, Version("0.34.0" if not with_apply else "0.32.0"))
    finally:
        sys.modules.pop(f"{name}.v1.structured_output.utils", None)
    on_utils = [p for p in found if getattr(p.owner, "__name__", "").endswith(".utils")]
    assert bool(on_utils) is with_apply
    assert ("the bitmask apply is vLLM's own" in caplog.text) is not with_apply
