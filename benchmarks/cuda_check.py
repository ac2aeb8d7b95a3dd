"""The CUDA path in one prepared run: identical outputs, masks resident on the GPU, per-step timings.

    python benchmarks/cuda_check.py [--device cuda] [--schemas 20] [--out DIR]

1. Identical outputs: for each of N real schemas (../shared/maskbench,
   $MASKBENCH_DATA, or the vendored sample; each compiled in a guarded
   worker, --timeout seconds and 8 GB, since some real schemas take minutes
   or tens of GB; one that fails is counted and replaced by the next by
   name), stock and cached outlines 1.3 processors replay a
   valid instance on random CUDA logits (B=4, rows in different states);
   every step's logits must be equal bit for bit.
2. Residency: the torch profiler counts host-to-device copies during warm
   cached steps (the mask rows live on the GPU, so there should be none
   that scale with the vocabulary) and during stock steps.
3. Timings with CUDA events per step at B = 1/8/32/128 and V = 128k (the
   Llama-3.2 tokenizer), json-dense grammar: stock, cached warm, and
   xgrammar's ``apply_token_bitmask_inplace`` on the same logits (the floor:
   applying a ready bitmask with a fused kernel).

Runs on CPU too (``--device cpu``, wall-clock timings) as a smoke test.
Writes ``cuda_check.json`` under --out and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import outlines_maskcache as mc
from outlines_maskcache.bench import maskbench
from outlines_maskcache.bench.material import tokenizer

DENSE = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "bio": {"type": "string"}},
                    "required": ["name", "bio"]})


def processors(index):
    from outlines.backends.outlines_core import OutlinesCoreLogitsProcessor

    return OutlinesCoreLogitsProcessor(index, "torch"), OutlinesCoreLogitsProcessor(index, "torch")


def identical(device: str, n_schemas: int, hf, vocabulary, vocab_key: str, timeout: float) -> dict:
    from outlines_core import Index

    checked = steps = 0
    gen = torch.Generator(device="cpu").manual_seed(0)
    usable = [g for g in maskbench.load_dataset() if any(ok for ok, _ in g.tests)]
    # Real schemas can take minutes or tens of GB to compile: each compiles in
    # a guarded worker (time and memory capped), several at once; one that
    # fails is counted and replaced by the next (by name).
    compiled, failed = maskbench.sample_that_compiles(usable, n_schemas, vocabulary, vocab_key, timeout=timeout,
                                                      max_bytes=8 << 30, workers=min(8, os.cpu_count() or 1),
                                                      keep_index=True)
    skipped = [f"{grammar.name}: {outcome.status}" for grammar, outcome in failed]
    for grammar, outcome in compiled:
        valid = [data for ok, data in grammar.tests if ok]
        index = Index.from_binary(outcome.index)
        tokens = hf.encode(json.dumps(valid[0]), add_special_tokens=False)
        stock, cached = processors(index)
        batch = 4
        ids = torch.zeros((batch, 1), dtype=torch.long, device=device)
        for i, token in enumerate(tokens[:64]):
            logits = torch.randn((batch, len(hf)), generator=gen).to(device)
            with mc.disabled():
                a = stock(ids.clone(), logits.clone())
            b = cached(ids.clone(), logits.clone())
            if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
                raise AssertionError(f"{grammar.name}: logits differ at step {i}")
            steps += 1
            if not bool(torch.isfinite(a[0, token])):  # the tokenization left the grammar: stop this instance
                break
            # Row 0 follows the instance; the others take other allowed tokens, so rows diverge.
            nxt = [token]
            for r in range(1, batch):
                allowed = torch.isfinite(a[r]).nonzero().flatten()
                nxt.append(int(allowed[r % len(allowed)]) if len(allowed) else hf.eos_token_id)
            ids = torch.cat([ids, torch.tensor(nxt, device=device).view(batch, 1)], dim=1)
        checked += 1
    return {"schemas_checked": checked, "steps_compared": steps, "skipped": skipped}


def _step_timer(device: str):
    if device.startswith("cuda"):
        def timed(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) * 1000  # µs
    else:
        def timed(fn):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6
    return timed


def h2d_copies(device: str, fn) -> int:
    """Host-to-device memcpy events the profiler saw while *fn* ran."""
    if not device.startswith("cuda"):
        return 0
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if "HtoD" in e.name or "Memcpy HtoD" in e.name)


def timings(device: str, vocabulary, width: int, batches: list[int], steps: int) -> list[dict]:
    import xgrammar as xgr
    from outlines_core import Index
    from outlines_core.json_schema import build_regex_from_schema

    index = Index(build_regex_from_schema(DENSE), vocabulary)
    timed = _step_timer(device)
    rows = []
    for batch in batches:
        stock, cached = processors(index)
        # Walk every row into the string field (the dense states a generation
        # spends its time in), then keep feeding a letter, which stays there.
        hf = tokenizer("llama3")
        walk = [hf.eos_token_id] + hf.encode('{"name": "Ada', add_special_tokens=False)
        letter = hf.encode("x", add_special_tokens=False)[0]
        pool = [torch.randn(batch, width, device=device) for _ in range(4)]
        for n in range(1, len(walk) + 1):
            prefix = torch.tensor([walk[:n]] * batch, device=device)
            with mc.disabled():
                stock(prefix, pool[0].clone())
            cached(prefix, pool[0].clone())
        ids = torch.tensor([walk + [letter]] * batch, device=device)
        bitmask = xgr.allocate_token_bitmask(batch, width).to(device)
        res = {"stock": [], "cached": [], "xgrammar_apply": []}
        h2d = {}
        for step in range(steps):
            logits = pool[step % 4].clone()
            with mc.disabled():
                res["stock"].append(timed(lambda: stock(ids, logits)))
            logits = pool[step % 4].clone()
            res["cached"].append(timed(lambda: cached(ids, logits)))
            logits = pool[step % 4].clone()
            res["xgrammar_apply"].append(timed(lambda: xgr.apply_token_bitmask_inplace(logits, bitmask)))
        logits = pool[0].clone()
        h2d["cached_warm"] = h2d_copies(device, lambda: cached(ids, logits))
        with mc.disabled():
            h2d["stock"] = h2d_copies(device, lambda: stock(ids, pool[1].clone()))
        rows.append({"batch": batch, "vocab": width, "median_us": {k: statistics.median(v[2:]) for k, v in res.items()},
                     "h2d_copies_per_step": h2d})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--schemas", type=int, default=20)
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per schema compile")
    parser.add_argument("--out", default=".")
    args = parser.parse_args(argv)
    from outlines_maskcache.ahead_of_time import outlines_vocabulary

    hf = tokenizer("llama3")
    vocabulary, vocab_key = outlines_vocabulary(hf)
    report = {"device": args.device, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None}
    report["identical"] = identical(args.device, args.schemas, hf, vocabulary, vocab_key, args.timeout)
    print("identical outputs:", report["identical"], flush=True)
    report["timings"] = timings(args.device, vocabulary, len(hf), [int(b) for b in args.batches.split(",")], args.steps)
    for row in report["timings"]:
        m = row["median_us"]
        print(f"B={row['batch']:>3} V={row['vocab']:,}: stock {m['stock']:,.1f} µs, cached {m['cached']:,.1f} µs "
              f"({m['stock'] / m['cached']:.1f}x), xgrammar apply {m['xgrammar_apply']:,.1f} µs; "
              f"H2D copies per step: {row['h2d_copies_per_step']}", flush=True)
    report["stats"] = mc.stats()
    out = Path(args.out) / "cuda_check.json"
    out.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
