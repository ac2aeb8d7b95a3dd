"""End to end over real schemas with every setup in one process, interleaved: TPOT ratios that host drift cannot sway.

``bench e2e --schemas DIR --interleaved R`` answers what the per-setup
processes of :mod:`~outlines_maskcache.bench.jsonschemabench` cannot at
the 1% level: on this shared host two processes running the same code
read wall-clock TPOT ratios 3% apart, because each drew differently fast
forward passes.  Here one process generates, for every schema, *R* rounds
of four generations of the same prompt and length — ``unconstrained``,
``noop`` (a processor that changes nothing: the engine's hook alone),
``stock`` (outlines as shipped, inside :func:`outlines_maskcache.disabled`)
and ``cached`` (the plugin) — in an order balanced over rounds and schemas
(each mode first, and right after each other mode, equally often).  Every ratio is a generation's TPOT over the
unconstrained TPOT *of the same round*, so drift between rounds cancels;
the figure is the median over all (schema, round) pairs with a 95%
bootstrap interval, and apart for first rounds (every state a first visit,
as in JSONSchemaBench) and later ones (a server that has generated for the
schema before).  Generation is greedy and the masks decide the text, so
cached's text is compared with stock's in every round (llama.cpp, whose
stream hands the text back).

TTFT is not reported: the same process compiles each schema twice (stock,
then the plugin's cold store), which the per-process setups measure
properly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

MODES = ("unconstrained", "noop", "stock", "cached")


def _child(engine: str, schemas_path: str, out_path: str, max_tokens: int, rounds: int) -> None:
    """The one process: *rounds* rounds of every mode per schema, written to *out_path* as JSON."""
    import outlines_maskcache as mc
    from outlines_maskcache.bench.jsonschemabench import generation_timer
    from outlines_maskcache.bench.paired import balanced_order

    schemas = json.loads(Path(schemas_path).read_text())
    generate = generation_timer(engine)

    def one(schema: str, mode: str, tokens: int) -> tuple[dict[str, Any], str]:
        text: list[str] = []
        if mode == "stock":
            with mc.disabled():
                return generate(schema, "constrained", tokens, text), "".join(text)
        return generate(schema, "constrained" if mode == "cached" else mode, tokens, text), "".join(text)

    for mode in ("unconstrained", "noop"):  # the engine's own first-call costs belong to no mode
        one("{}", mode, 4)
    rows = []
    for k, schema in enumerate(schemas):
        # An untimed stock generation sets the length the unconstrained and
        # no-op generations decode to (stock leaves nothing in the plugin's
        # cache, so the first round is still every state's first visit).
        length = max(2, one(schema, "stock", max_tokens)[0]["tokens"])
        per_round = []
        for r in range(rounds):
            timings, texts = {}, {}
            for mode in balanced_order(MODES, k + r):
                timings[mode], texts[mode] = one(schema, mode, max_tokens if mode in ("stock", "cached") else length)
            # Only llama.cpp's stream hands back the text; transformers' rounds are not compared (None).
            same = texts["cached"] == texts["stock"] if engine == "llamacpp" else None
            per_round.append({**timings, "same_as_stock": same})
        rows.append({"rounds": per_round})
    Path(out_path).write_text(json.dumps(rows))


def run(schemas: list[str], engine: str, max_tokens: int, rounds: int) -> list[dict[str, Any]]:
    """Run the interleaved process (plugin installed, an empty store of its own) and return its rows."""
    import tempfile

    from outlines_maskcache.bench.fresh_process import failure_line, run_fresh

    with tempfile.TemporaryDirectory(prefix="maskcache-e2e-interleaved-") as tmp:
        listing, out = Path(tmp) / "schemas.json", Path(tmp) / "out.json"
        listing.write_text(json.dumps(schemas))
        proc = run_fresh("outlines_maskcache.bench.e2e_interleaved",
                         [engine, str(listing), str(out), str(max_tokens), str(rounds)],
                         plugin=True, store=Path(tmp) / "store", capture=True)
        if proc.returncode != 0:
            raise RuntimeError(failure_line(proc))
        return json.loads(out.read_text())


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode: TPOT over the same round's unconstrained TPOT, median [95% CI], for all, first and later rounds."""
    from outlines_maskcache.bench.paired import bootstrap_median

    def ratios(mode: str, pick: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]) -> list[float]:
        return [x[mode]["tpot"] / x["unconstrained"]["tpot"] for row in rows for x in pick(row["rounds"])
                if x[mode]["tpot"] and x["unconstrained"]["tpot"]]

    def extra(mode: str) -> list[float]:
        return [1000 * (x[mode]["sample"] - x["unconstrained"]["sample"]) for row in rows for x in row["rounds"]
                if "sample" in x[mode] and "sample" in x["unconstrained"]]

    base = [x["unconstrained"]["tpot"] for row in rows for x in row["rounds"] if x["unconstrained"]["tpot"]]
    out = [{"mode": "unconstrained", "tpot_ms_median": 1000 * float(np.median(base)) if base else None}]
    for mode in MODES[1:]:
        entry: dict[str, Any] = {"mode": mode}
        for name, pick in (("all", lambda r: r), ("first", lambda r: r[:1]), ("later", lambda r: r[1:])):
            values = ratios(mode, pick)
            entry[name] = (*bootstrap_median(values), len(values)) if values else None
        if values := extra(mode):
            entry["sampling_extra_ms"] = bootstrap_median(values)
        out.append(entry)
    same = [x["same_as_stock"] for row in rows for x in row["rounds"] if x["same_as_stock"] is not None]
    out[0]["same_as_stock"] = [sum(same), len(same)]
    return out


def print_summary(summary: list[dict[str, Any]], engine: str, schemas: int, rounds: int) -> None:
    from outlines_maskcache.bench.report import table

    def ratio(v: tuple[float, float, float, int] | None) -> str:
        return "-" if v is None else f"{v[0]:.3f}x [{v[1]:.3f}-{v[2]:.3f}] (n={v[3]})"

    lines = []
    for entry in summary[1:]:
        ms = entry.get("sampling_extra_ms")
        lines.append([entry["mode"], ratio(entry["all"]), ratio(entry["first"]), ratio(entry["later"]),
                      "-" if ms is None else f"{ms[0]:+.3f} [{ms[1]:+.3f}/{ms[2]:+.3f}]"])
    same, total = summary[0]["same_as_stock"]
    table(f"{engine}, {schemas} schemas x {rounds} interleaved rounds in one process; unconstrained TPOT "
          f"{summary[0]['tpot_ms_median']:.2f} ms (median); cached text = stock's in {same}/{total} rounds",
          ["mode", "TPOT / unconstrained, all rounds", "first rounds", "later rounds", "sampling +ms/token"], lines)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
