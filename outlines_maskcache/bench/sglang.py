"""Per-row mask fill in SGLang's outlines backend, stock vs cached: ``outlines-maskcache bench sglang``.

Runs in an environment with sglang (see .ci/lanes/50-sglang.sh).  For a
dense state (inside a JSON string: nearly every token allowed) and a sparse
one (a digit of a regex), it times ``OutlinesGrammar.fill_vocab_mask`` on a
fresh (B, V) mask row, SGLang's own code under ``disabled()`` and the cached
fill, interleaved repeat by repeat, at GPT-2's 50k and Llama-3.2's 128k
vocabularies.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

STATES = {
    # (key, prefix that walks the grammar into the state)
    "dense": (("json", json.dumps({"type": "object", "properties": {"bio": {"type": "string"}}, "required": ["bio"]})),
              '{"bio": "Hello'),
    "sparse": (("regex", r"[0-9]{1,6}(, [0-9]{1,6}){0,9}"), "12, 3"),
}


def run(tokenizers: tuple[str, ...] = ("gpt2", "llama3"), repeats: int = 200) -> list[dict[str, Any]]:
    from sglang.srt.constrained.outlines_backend import OutlinesGrammarBackend

    import outlines_maskcache as mc
    from outlines_maskcache.bench.material import tokenizer

    mc.install(targets=["sglang"])
    rows = []
    for name in tokenizers:
        tok = tokenizer(name)
        backend = OutlinesGrammarBackend(tok, whitespace_pattern=None)
        width = len(tok)
        for kind, (key, prefix) in STATES.items():
            grammar = backend.dispatch_json(key[1]) if key[0] == "json" else backend.dispatch_regex(key[1])
            for token in tok.encode(prefix, add_special_tokens=False):
                grammar.accept_token(token)
            mask = grammar.allocate_vocab_mask(width, 8, "cpu")
            allowed = int((~_fill(grammar, mask, cached=False)[0]).sum())
            times: dict[str, list[float]] = {"stock": [], "cached": []}
            _fill(grammar, mask, cached=True)  # warm: the state's row is cached
            for _ in range(repeats):
                for variant in ("stock", "cached"):
                    mask.zero_()
                    t0 = time.perf_counter()
                    _fill(grammar, mask, cached=variant == "cached")
                    times[variant].append((time.perf_counter() - t0) * 1e6)
            rows.append({"tokenizer": name, "vocab": width, "state": kind, "allowed": allowed,
                         "stock_us": statistics.median(times["stock"]), "cached_us": statistics.median(times["cached"])})
    return rows


def _fill(grammar: Any, mask: Any, cached: bool) -> Any:
    import outlines_maskcache as mc

    if cached:
        grammar.fill_vocab_mask(mask, 3)
    else:
        with mc.disabled():
            grammar.fill_vocab_mask(mask, 3)
    return mask[3:4]


def print_table(rows: list[dict[str, Any]]) -> None:
    from outlines_maskcache.bench.report import table

    table("SGLang fill_vocab_mask per row (median µs)", ["tokenizer", "V", "state", "allowed", "stock", "cached", "stock/cached"],
          [[r["tokenizer"], f"{r['vocab']:,}", r["state"], f"{r['allowed']:,}", f"{r['stock_us']:,.1f}",
            f"{r['cached_us']:,.1f}", f"{r['stock_us'] / r['cached_us']:.1f}x"] for r in rows])
