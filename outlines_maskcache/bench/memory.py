"""Memory: bytes per cached state, and the byte budget holding on a grammar with thousands of states.

A grammar whose every step lands in a new state (a fixed-length string)
is walked with the cache on under a budget far smaller than its rows would
need; the peak of the cache's bytes is read after every step.  Rows are
dense (512 KiB at 128k fp32) or sparse (the allowed ids), per
``sparse_below``; both are reported.
"""

from __future__ import annotations

import time
from typing import Any

import torch

import outlines_maskcache as mc


#: character classes: letters make dense states (tens of thousands of tokens
#: allowed), digits sparse ones (about a thousand number tokens in Llama-3)
CLASSES = {"letters": "[a-z]", "digits": "[0-9]"}


def budget_walk(tokenizer_name: str, states: int, budget: int, chars: str = "letters", batch: int = 4,
                sparse_below: float | None = None) -> dict[str, Any]:
    from outlines import backends

    from outlines_maskcache.bench.material import tokenizer
    from outlines_maskcache.bench.micro import Loop, outlines_model

    model = outlines_model(tokenizer(tokenizer_name))
    width = int(model.model.config.vocab_size)
    # Every token advances by its length, so the walk keeps meeting new states.
    regex = f"{CLASSES[chars]}{{{states}}}"
    t0 = time.perf_counter()
    processor = backends.get_regex_logits_processor("outlines_core", model, regex)
    compile_s = time.perf_counter() - t0
    previous = mc.settings()
    mc.clear()
    mc.reset_stats()
    mc.configure(max_bytes=budget, **({} if sparse_below is None else {"sparse_below": sparse_below}))
    try:
        pool = Loop("hot", batch, width, torch.device("cpu")).pool
        ids = torch.zeros(batch, 1, dtype=torch.long)
        peak, seen = 0, set()
        for steps in range(1, states + 1):
            out = processor(ids, pool[steps % len(pool)].clone())
            seen.update(g.get_state() for g in processor._guides)
            peak = max(peak, max(mc.stats()["bytes_by_device"].values(), default=0))
            nxt = out.argmax(dim=-1, keepdim=True)
            if bool((out.max(dim=-1).values == -torch.inf).any()):
                break
            ids = torch.cat([ids, nxt], dim=1)
            if any(g.is_finished() for g in processor._guides):
                break
        stats = mc.stats()
    finally:
        mc.configure(max_bytes=previous.max_bytes, sparse_below=previous.sparse_below)
    return {
        "tokenizer": tokenizer_name, "vocab": width, "grammar_states": states, "regex": regex,
        "compile_s": compile_s, "batch": batch, "steps": steps, "distinct_states_visited": len(seen),
        "budget": budget, "peak_bytes": peak, "within_budget": peak <= budget,
        "entries": stats["entries"], "evictions": stats["evictions"], "misses": stats["misses"],
        "bytes_per_entry": stats["bytes"] / stats["entries"] if stats["entries"] else 0.0,
        "sparse_below": mc.settings().sparse_below if sparse_below is None else sparse_below,
    }


def print_memory(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        print(f"memory {r['tokenizer']} (V={r['vocab']:,}), {r['regex']} (compiled in {r['compile_s']:.1f} s), "
              f"B={r['batch']}, sparse_below={r['sparse_below']:.4g}: {r['steps']} steps, "
              f"{r['distinct_states_visited']} states visited, {r['misses']} misses, {r['evictions']} evictions; "
              f"peak {r['peak_bytes']:,} B of a {r['budget']:,} B budget ({'within' if r['within_budget'] else 'OVER'}); "
              f"{r['bytes_per_entry']:,.0f} B per cached state")
