"""``outlines-maskcache bench``: the benchmark suites' command line (the product's CLI only hands ``bench`` over).

Each suite's measurement lives in its own module of this package; this
module parses its arguments, runs it, prints it and writes its JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

import outlines_maskcache as mc
from outlines_maskcache.bench.maskbench import ENGINES as _ENGINES
from outlines_maskcache.bench.run_record import write_json
from outlines_maskcache.config import size_argument


def _csv(kind: Callable[[str], Any]) -> Callable[[str], list]:
    return lambda text: [kind(x) for x in text.split(",") if x]


def _progress(total: int) -> tuple[Callable[[], None], Callable[[], None]]:
    try:
        from rich.progress import Progress
    except ImportError:  # rich is in the `bench` extra; degrade to silence
        return (lambda: None), (lambda: None)
    bar = Progress(transient=True)
    task = bar.add_task("benchmarking", total=total)
    bar.start()
    return (lambda: bar.advance(task)), bar.stop


def _fmt(x: float | None, unit: str = "") -> str:
    return "-" if x is None else f"{x:,.1f}{unit}"


def print_micro(cases: list) -> None:
    from outlines_maskcache.bench.micro import VARIANTS

    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = Table = None  # type: ignore[assignment]
    present = [v for v in VARIANTS if any(v in c.median_us for c in cases)]
    headers = ["tokenizer", "grammar", "walk", "B", "V"] + [f"{v} µs" for v in present] \
        + ["warm/floor", "warm/floor-rows", "stock/warm"]
    rows = []
    for c in cases:
        rows.append([c.tokenizer, c.grammar, c.walk, str(c.batch), f"{c.vocab:,}"]
                    + [_fmt(c.median_us.get(v)) for v in present]
                    + [_fmt(c.ratio("cached-warm", "floor"), "x"), _fmt(c.ratio("cached-warm", "floor-rows"), "x"),
                       _fmt(c.ratio("stock", "cached-warm"), "x")])
    if Table is None:
        print("\t".join(headers))
        for row in rows:
            print("\t".join(row))
        return
    table = Table(title=f"per-step processor time (median), {cases[0].loop if cases else ''} loop")
    for h in headers:
        table.add_column(h, justify="right")
    for row in rows:
        table.add_row(*row)
    # Off a terminal (CI logs, pipes) rich would squeeze the table to 80 columns.
    Console(width=None if sys.stdout.isatty() else 220).print(table)


def plot_micro(cases: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grammars = sorted({c.grammar for c in cases})
    fig, axes = plt.subplots(1, len(grammars), figsize=(6 * len(grammars), 4.5), squeeze=False)
    for ax, grammar in zip(axes[0], grammars):
        subset = [c for c in cases if c.grammar == grammar]
        variants = sorted({v for c in subset for v in c.median_us})
        labels = [f"{c.tokenizer} {c.walk}\nB={c.batch}" for c in subset]
        width = 0.8 / max(1, len(variants))
        for k, variant in enumerate(variants):
            xs = [i + k * width for i in range(len(subset))]
            ax.bar(xs, [c.median_us.get(variant, 0) for c in subset], width, label=variant)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(subset))], labels)
        ax.set_yscale("log")
        ax.set_ylabel("µs per step (median, log)")
        ax.set_title(grammar)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def cmd_bench(args: argparse.Namespace) -> int:
    from outlines_maskcache.bench import micro

    _check_micro_args(args)
    if args.quick:
        args.tokenizers, args.batch, args.steps, args.repeats, args.walks = ["gpt2"], [1, 8], 6, 1, ["greedy"]
    results: dict[str, Any] = {"settings": vars(args).copy()}
    advance, stop = _progress(len(args.tokenizers) * 2 * len(args.batch) * len(args.walks) * args.repeats
                              * len(micro.VARIANTS))
    try:
        cases = micro.run(args.tokenizers, list(micro.GRAMMARS), args.batch, args.steps, args.repeats,
                          device=args.device, progress_factory=lambda total: advance, loop=args.loop,
                          walks=tuple(args.walks))
    finally:
        stop()
    print_micro(cases)
    results["micro"] = micro.as_json(cases)
    if args.memory:
        from outlines_maskcache.bench import memory

        states, budget = (300, 16 << 20) if args.quick else (10_000, 256 << 20)
        name = args.tokenizers[-1]
        results["memory"] = [memory.budget_walk(name, states, budget, chars) for chars in memory.CLASSES]
        memory.print_memory(results["memory"])
    if args.e2e or args.compile:
        from outlines_maskcache.bench import e2e

        if args.compile:
            results["compile"] = e2e.compile_latency(args.tokenizers[0], repeats=2 if args.quick else 3)
            e2e.print_compile(results["compile"])
        if args.e2e:
            results["e2e"] = e2e.throughput(args.engines, batches=[1] if args.quick else [1, 8],
                                            new_tokens=16 if args.quick else 64, repeats=1 if args.quick else 3)
            e2e.print_throughput(results["e2e"])
    results["stats"] = mc.stats()
    results["settings"]["tokenizers"] = args.tokenizers
    if args.json:
        write_json(args.json, results)
    if args.plot:
        plot_micro(cases, Path(args.plot))
        print(f"wrote {args.plot}")
    return 0


def cmd_maskbench(args: argparse.Namespace) -> int:
    from outlines_maskcache.bench import maskbench
    from outlines_maskcache.bench.report import progress_bar

    try:
        grammars = maskbench.load_dataset(args.data)
    except FileNotFoundError as err:
        raise SystemExit(f"outlines-maskcache: {err}") from None
    if args.sample:
        grammars = maskbench.sample(grammars, args.sample)
    if args.limit:
        grammars = grammars[: args.limit]
    with progress_bar(len(grammars), "MaskBench schemas") as advance:
        result = maskbench.run(tokenizer_name=args.tokenizer, engines=tuple(args.engines), timeout=args.timeout,
                               max_bytes=args.max_memory, workers=args.workers, check=not args.no_check,
                               grammars=grammars, progress=advance)
    maskbench.print_result(result, markdown=args.md)
    if args.json:
        write_json(args.json, maskbench.as_json(result))
    if args.plot:
        maskbench.plot_cdf(result, args.plot)
        print(f"wrote {args.plot}")
    return 0 if result.conformant() else 1


def cmd_vllm(args: argparse.Namespace) -> int:
    from outlines_maskcache.bench import vllm

    return vllm.main_args(args)


def cmd_setup(args: argparse.Namespace) -> int:
    from outlines_maskcache.bench import maskbench, setup

    grammars = maskbench.sample(maskbench.load_dataset(args.data, with_tests=False), args.sample)
    result = setup.run([g.spec for g in grammars], args.tokenizer, args.timeout)
    setup.print_summary(result)
    if args.json:
        write_json(args.json, dict(result, summary=setup.summarize(result)))
    return 0


def cmd_lazy(args: argparse.Namespace) -> int:
    from outlines_maskcache.bench import lazy, maskbench
    from outlines_maskcache.bench.report import progress_bar

    grammars = maskbench.sample(maskbench.load_dataset(args.data), args.sample)
    if args.names:
        grammars = [g for g in grammars if g.name in args.names.split(",")]
    rows = open(args.rows, "w", encoding="utf-8") if args.rows else None  # noqa: SIM115 - closed below
    try:
        with progress_bar(len(grammars), "schemas") as advance:
            def done(row: dict[str, Any]) -> None:
                if rows is not None:
                    rows.write(json.dumps(row) + "\n")
                    rows.flush()
                advance()

            result = lazy.run(grammars, args.tokenizer, args.timeout, progress=done)
    finally:
        if rows is not None:
            rows.close()
    lazy.print_result(result)
    if args.json:
        write_json(args.json, lazy.as_json(result))
    return 0


def cmd_sglang(args: argparse.Namespace) -> int:
    from outlines_maskcache.bench import sglang

    rows = sglang.run(tuple(args.tokenizers), args.repeats)
    sglang.print_table(rows)
    if args.json:
        write_json(args.json, rows)
    return 0


def cmd_e2e(args: argparse.Namespace) -> int:
    from outlines_maskcache.bench import paired
    from outlines_maskcache.bench.report import progress_bar

    if args.schemas:
        return _e2e_schemas(args)
    rows = []
    with progress_bar(len(args.model) * len(args.batch) * args.rounds * 5, "generate rounds") as advance:
        for name in args.model:
            rows += paired.run_model(name, args.batch, args.rounds, args.new_tokens, progress=advance,
                                    device=args.device)
    paired.print_rows(rows)
    if args.json:
        write_json(args.json, paired.as_json(rows))
    return 0 if all(all(r.same_as_stock.values()) for r in rows) else 1


def _e2e_schemas(args: argparse.Namespace) -> int:
    from outlines_maskcache.bench import jsonschemabench as jsb
    from outlines_maskcache.bench import maskbench
    from outlines_maskcache.bench.material import hf_smollm2 as _hf_smollm2
    from outlines_maskcache.bench.report import progress_bar

    try:
        grammars = maskbench.load_dataset(args.schemas, with_tests=False)
    except FileNotFoundError as err:
        raise SystemExit(f"outlines-maskcache: {err}") from None
    _, hf_tokenizer = _hf_smollm2()
    chosen, left = jsb.select(grammars, args.n, args.match, args.timeout, args.max_memory, hf_tokenizer)
    if not chosen:
        raise SystemExit("outlines-maskcache: no schema compiled within the limits")
    if args.interleaved:
        return _e2e_interleaved(args, [g.spec for g in chosen], [g.name for g in chosen], left)
    with progress_bar(len(args.engines) * len(jsb.SETUPS), "setups (one process each)") as advance:
        results = jsb.run([g.spec for g in chosen], tuple(args.engines), args.max_tokens, progress=advance,
                          repeats=args.repeats)
    rows = jsb.summarize(results)
    jsb.print_summary(rows, len(chosen), left)
    if args.json:
        write_json(args.json, {"schemas": [g.name for g in chosen], "left_out": left, "summary": rows,
                               "raw": results})
    return 1 if any("skipped" in r for r in rows) else 0  # an engine asked for and not run is a failure


def _e2e_interleaved(args: argparse.Namespace, specs: list[str], names: list[str], left: dict[str, int]) -> int:
    from outlines_maskcache.bench import e2e_interleaved
    from outlines_maskcache.bench.report import progress_bar

    results: dict[str, Any] = {}
    with progress_bar(len(args.engines), "engines (one interleaved process each)") as advance:
        for engine in args.engines:
            try:
                rows = e2e_interleaved.run(specs, engine, args.max_tokens, args.interleaved)
            except RuntimeError as err:
                results[engine] = {"skipped": str(err)}
            else:
                results[engine] = {"summary": e2e_interleaved.summarize(rows), "raw": rows}
            advance()
    for engine, result in results.items():
        if "skipped" in result:
            print(f"{engine}: skipped: {result['skipped']}")
        else:
            e2e_interleaved.print_summary(result["summary"], engine, len(specs), args.interleaved)
    if args.json:
        write_json(args.json, {"schemas": names, "left_out": left, "rounds": args.interleaved, "engines": results})
    ok = all("skipped" not in r and r["summary"][0]["same_as_stock"][0] == r["summary"][0]["same_as_stock"][1]
             for r in results.values())
    return 0 if ok else 1


def _started(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """*command*, noting its start (time and commit) for the run record first."""
    def run(args: argparse.Namespace) -> int:
        from outlines_maskcache.bench import run_record

        run_record.mark_start()
        return command(args)

    return run


def add_bench_parser(sub: Any) -> None:
    """The ``bench`` command and its suites, under the product CLI's subcommands *sub*."""
    bench = sub.add_parser("bench", help="measure stock vs cached side by side")
    bench.add_argument("--tokenizers", type=_csv(str), default=["gpt2", "llama3"])
    bench.add_argument("--batch", type=_csv(int), default=[1, 8, 32])
    bench.add_argument("--steps", type=int, default=24)
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--device", default="cpu")
    bench.add_argument("--loop", choices=["realistic", "hot"], default="realistic",
                       help="realistic: a cache-evicting sweep and fresh logits before every step (default); hot: neither")
    bench.add_argument("--walks", type=_csv(str), default=["greedy", "random"],
                       help="greedy (argmax) and/or random (seeded draws that keep rows moving between states)")
    bench.add_argument("--quick", action="store_true", help="a few seconds: proves the benchmark works")
    bench.add_argument("--e2e", action="store_true", help="also tokens/s of SmolLM2-135M end to end")
    bench.add_argument("--engines", type=_csv(str), default=["transformers", "llamacpp"])
    bench.add_argument("--compile", action="store_true", help="also first vs repeated model(prompt, Schema) setup")
    bench.add_argument("--memory", action="store_true",
                       help="also the byte budget on a 10,000-state grammar (300 with --quick): peak bytes, bytes per state")
    bench.add_argument("--json", help="write machine-readable results here")
    bench.add_argument("--plot", help="write a PNG of step time per variant here")
    bench.set_defaults(func=_started(cmd_bench))
    suites = bench.add_subparsers(dest="suite", metavar="{maskbench,vllm,setup,sglang}")
    mb = suites.add_parser("maskbench", help="MaskBench replay over real schemas: TBM, TTFM, conformance")
    mb.add_argument("--data", help="MaskBench data folder (default: $MASKBENCH_DATA, ../shared/maskbench, tests/data/maskbench)")
    mb.add_argument("--tokenizer", default="llama3", help="llama3 (MaskBench's), gpt2, or a tokenizer folder")
    mb.add_argument("--limit", type=int, help="only the first N schemas (by name)")
    mb.add_argument("--sample", type=int, help="an evenly spread fixed sample of N schemas")
    mb.add_argument("--engines", type=_csv(str), default=list(_ENGINES))
    mb.add_argument("--timeout", type=float, default=60.0, help="seconds per compile (MaskBench: 900)")
    mb.add_argument("--max-memory", type=size_argument, default=8 << 30, help="memory cap per compile worker (e.g. 8G)")
    mb.add_argument("--workers", type=int, default=1, help="compile worker processes")
    mb.add_argument("--no-check", action="store_true", help="skip the cached == stock conformance checks")
    mb.add_argument("--json")
    mb.add_argument("--plot", help="PNG of the TBM CDF per engine")
    mb.add_argument("--md", action="store_true", help="print markdown tables")
    mb.set_defaults(func=_started(cmd_maskbench))
    vl = suites.add_parser("vllm", help="offline vLLM throughput: unconstrained, stock, mask cache, full plugin")
    vl.add_argument("--tokenizer", default="llama3", choices=["llama3", "gpt2"])
    vl.add_argument("--batch", type=_csv(int), default=[8, 32, 128])
    vl.add_argument("--grammars", type=_csv(str), default=["json-dense", "regex-sparse", "maskbench"])
    vl.add_argument("--schemas", type=int, default=4, help="real schemas from the MaskBench data for 'maskbench'")
    vl.add_argument("--data", help="MaskBench data folder")
    vl.add_argument("--new-tokens", type=int, default=96)
    vl.add_argument("--repeats", type=int, default=3)
    vl.add_argument("--variants", type=_csv(str), default=None,
                    help="any of unconstrained (required), stock, maskcache, plugin (default: all)")
    vl.add_argument("--json")
    vl.set_defaults(func=_started(cmd_vllm))
    se = suites.add_parser("setup", help="processor setup in a fresh process: stock, cold store, warm store")
    se.add_argument("--data", help="MaskBench data folder")
    se.add_argument("--sample", type=int, default=40, help="schemas (an evenly spread fixed sample)")
    se.add_argument("--tokenizer", default="llama3", choices=["llama3", "gpt2"])
    se.add_argument("--timeout", type=float, default=30.0, help="seconds per compile in the cold run")
    se.add_argument("--json")
    se.set_defaults(func=_started(cmd_setup))
    lz = suites.add_parser("lazy", help="a never-seen schema's first mask: stock's full compile vs the lazy Index")
    lz.add_argument("--data", help="MaskBench data folder")
    lz.add_argument("--sample", type=int, default=40, help="schemas (an evenly spread fixed sample)")
    lz.add_argument("--tokenizer", default="llama3", choices=["llama3", "gpt2"])
    lz.add_argument("--timeout", type=float, default=30.0, help="seconds per stock compile (and per lazy rescue)")
    lz.add_argument("--names", help="only these schemas of the sample (comma-separated)")
    lz.add_argument("--rows", help="stream each schema's row to this JSON-lines file as it is done (long runs)")
    lz.add_argument("--json")
    lz.set_defaults(func=_started(cmd_lazy))
    sg = suites.add_parser("sglang", help="SGLang fill_vocab_mask per row, stock vs cached (needs sglang)")
    sg.add_argument("--tokenizers", type=_csv(str), default=["gpt2", "llama3"])
    sg.add_argument("--repeats", type=int, default=200)
    sg.add_argument("--json")
    sg.set_defaults(func=_started(cmd_sglang))
    e2e = suites.add_parser("e2e", help="transformers generate: constrained / unconstrained tok/s with 95%% CIs")
    e2e.add_argument("--model", type=_csv(str), default=["head128k"], help="head128k (2 layers, 128k head), smollm2")
    e2e.add_argument("--batch", type=_csv(int), default=[1, 8])
    e2e.add_argument("--rounds", type=int, default=15, help="interleaved rounds (every variant once each)")
    e2e.add_argument("--new-tokens", type=int, default=32)
    e2e.add_argument("--device", default="cpu", help="with --model: where the model and its logits live (cpu, cuda)")
    e2e.add_argument("--json")
    e2e.add_argument("--schemas", metavar="DIR",
                     help="JSONSchemaBench style instead: TTFT/TPOT of SmolLM2-135M over the schemas in DIR "
                          "(MaskBench/JSONSchemaBench files or plain schemas), stock / cold / warm store")
    e2e.add_argument("--engines", type=_csv(str), default=["llamacpp", "transformers"], help="with --schemas")
    e2e.add_argument("-n", type=int, default=20, help="with --schemas: how many schemas")
    e2e.add_argument("--match", default="Glaive", help="with --schemas: only names containing this ('' for all)")
    e2e.add_argument("--max-tokens", type=int, default=48, help="with --schemas")
    e2e.add_argument("--repeats", type=int, default=1,
                     help="with --schemas: rounds per schema (the later ones in a balanced order; TPOT ratios only)")
    e2e.add_argument("--interleaved", type=int, default=0, metavar="ROUNDS",
                     help="with --schemas: instead of a process per setup, one process running unconstrained, "
                          "no-op, stock and cached per schema for ROUNDS rounds in a balanced order (TPOT ratios within a round)")
    e2e.add_argument("--timeout", type=float, default=20.0, help="with --schemas: compile limit per schema (s)")
    e2e.add_argument("--max-memory", type=size_argument, default=6 << 30, help="with --schemas: memory cap per compile")
    e2e.set_defaults(func=_started(cmd_e2e))


def _check_micro_args(args: argparse.Namespace) -> None:
    """The micro benchmark's list arguments, checked before anything is measured (a usage error: exit 2)."""
    problem = next((f"unknown tokenizer {name!r} (gpt2, llama3)" for name in args.tokenizers
                    if name not in ("gpt2", "llama3")), None)
    if problem is None and (any(b < 1 for b in args.batch) or args.steps < 2 or args.repeats < 1):
        problem = "--batch values, --repeats must be >= 1 and --steps >= 2"
    if problem is not None:
        print(f"outlines-maskcache bench: error: {problem}", file=sys.stderr)
        raise SystemExit(2)
