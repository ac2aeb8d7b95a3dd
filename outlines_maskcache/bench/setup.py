"""Processor setup in a fresh process: ``outlines-maskcache bench setup``.

What a new process pays before its first mask for a schema: outlines 1.2+'s
``OutlinesCoreBackend(model).get_json_schema_logits_processor(schema)``
(vocabulary conversion, regex, Index), timed after the model is built.
Four variants, each in its own fresh process over the same schemas:

* ``stock``: outlines as shipped (``OUTLINES_MASKCACHE=0``);
* ``cold-store``: the plugin with an empty store and the lazy Index off
  (it compiles in the guarded worker and saves);
* ``cold-store-lazy``: the plugin with another empty store and the lazy
  Index on (the first processor gets a lazy Index; the full compile runs
  behind it, untimed);
* ``warm-store``: the plugin with the store the cold run filled.

The first schema of each process also pays the backend (vocabulary) setup,
reported separately as ``first``; the percentiles are over the schemas
after it, each new to its process.  Schemas that the cold run could not
compile within the time limit (in a guarded child) are left out of every
variant and counted.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from outlines_maskcache.bench.fresh_process import run_fresh

VARIANTS = ("stock", "cold-store", "cold-store-lazy", "warm-store")


def _child(variant: str, tokenizer_name: str, schemas_path: str, out_path: str, timeout: float) -> None:
    import outlines

    import outlines_maskcache as mc
    from outlines_maskcache.bench.material import tiny_model, tokenizer
    from outlines_maskcache.guard import CompileFailed

    schemas = json.loads(Path(schemas_path).read_text())
    tok = tokenizer(tokenizer_name)
    model = outlines.from_transformers(tiny_model(tok, arch="llama"), tok)
    from outlines.backends.outlines_core import OutlinesCoreBackend

    if variant.startswith("cold-store"):
        mc.configure(compile_timeout=timeout, compile_max_bytes=8 << 30, lazy_index=variant == "cold-store-lazy")
    times: list[float | None] = []
    for schema in schemas:
        t0 = time.perf_counter()
        try:
            OutlinesCoreBackend(model).get_json_schema_logits_processor(schema)
            times.append(time.perf_counter() - t0)
        except (CompileFailed, ValueError, RuntimeError):
            times.append(None)
    stats = mc.stats() if variant != "stock" else {}
    if variant == "cold-store":  # untimed, as a deploy's `outlines-maskcache compile` would: the lazy Index's
        mc.precompile(tok, [])    # token table joins the store, and the store writes are waited for
    Path(out_path).write_text(json.dumps({"times": times, "store": stats.get("store"),
                                          "lazy_index": stats.get("lazy_index")}))


def run(schemas: list[str], tokenizer_name: str = "llama3", timeout: float = 30.0) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="maskcache-setup-") as tmp:
        store = Path(tmp) / "store"
        results: dict[str, Any] = {}

        def child(variant: str, todo: list[str]) -> dict[str, Any]:
            (Path(tmp) / "schemas.json").write_text(json.dumps(todo))
            out = Path(tmp) / f"{variant}.json"
            own_store = Path(tmp) / "lazy-store" if variant == "cold-store-lazy" else store  # empty as well
            run_fresh("outlines_maskcache.bench.setup",
                      [variant, tokenizer_name, str(Path(tmp) / "schemas.json"), str(out), str(timeout)],
                      plugin=variant != "stock", store=own_store)
            return json.loads(out.read_text())

        cold = child("cold-store", schemas)
        kept = [s for s, t in zip(schemas, cold["times"]) if t is not None]
        results["cold-store"] = [t for t in cold["times"] if t is not None]
        lazy = child("cold-store-lazy", kept)
        results["cold-store-lazy"] = lazy["times"]
        results["warm-store"] = child("warm-store", kept)["times"]
        results["stock"] = child("stock", kept)["times"]
        return {"schemas": len(schemas), "left_out": len(schemas) - len(kept), "seconds": results,
                "lazy_index": lazy.get("lazy_index")}


def summarize(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    out = {}
    for variant in VARIANTS:
        times = [t for t in result["seconds"][variant] if t is not None]
        rest = np.asarray(times[1:]) * 1000
        out[variant] = {"first_ms": times[0] * 1000 if times else float("nan"),
                        "p50_ms": float(np.percentile(rest, 50)) if rest.size else float("nan"),
                        "p90_ms": float(np.percentile(rest, 90)) if rest.size else float("nan"),
                        "max_ms": float(rest.max()) if rest.size else float("nan")}
        if variant != "stock":  # per schema over stock's time for the same schema, the first schema left out
            pairs = [(t, st) for t, st in zip(result["seconds"][variant][1:], result["seconds"]["stock"][1:])
                     if t is not None and st]
            ratios = np.asarray([t / st for t, st in pairs])
            out[variant].update(over_stock_p50=float(np.percentile(ratios, 50)) if ratios.size else float("nan"),
                                over_stock_p90=float(np.percentile(ratios, 90)) if ratios.size else float("nan"))
    return out


def print_summary(result: dict[str, Any]) -> None:
    from outlines_maskcache.bench.report import table

    summary = summarize(result)
    table(f"processor setup in a fresh process ({result['schemas'] - result['left_out']} schemas, "
          f"{result['left_out']} left out)",
          ["variant", "first schema (+ vocabulary) ms", "p50 ms", "p90 ms", "max ms", "/stock p50", "/stock p90"],
          [[v, *(f"{summary[v][k]:,.1f}" for k in ("first_ms", "p50_ms", "p90_ms", "max_ms")),
            *(f"{summary[v].get(k, float('nan')):.3f}" for k in ("over_stock_p50", "over_stock_p90"))]
           for v in VARIANTS])


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]))
