"""Per-step processor time: stock outlines_core vs cached (cold, warm) vs xgrammar/llguidance vs the floor.

Every variant decodes greedily over the same stream of random logits, so the
cached and stock variants walk the same paths (their masks are identical);
rows get different logits and so sit in different states.  Repeats are
interleaved variant by variant, so machine noise hits all variants alike,
and medians are reported.  The floor is one in-place ``add_`` of a (B, V)
tensor over the same logits: the least any mask can cost.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import torch

import outlines_maskcache as mc

SCHEMA = json.dumps({
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "bio": {"type": "string"},
        "email": {"type": "string"},
        "age": {"type": "integer"},
    },
    "required": ["name", "bio", "email", "age"],
})
SPARSE_REGEX = r"\(\d{3}\) \d{3}-\d{4}( x\d{1,5})?"
GRAMMARS = {"json-dense": ("json", SCHEMA), "regex-sparse": ("regex", SPARSE_REGEX)}
VARIANTS = ("floor", "stock", "cached-cold", "cached-warm", "xgrammar", "llguidance")


@dataclass
class Case:
    tokenizer: str
    grammar: str
    batch: int
    vocab: int
    #: per-variant median step time in microseconds
    median_us: dict[str, float] = field(default_factory=dict)

    def ratio(self, variant: str, to: str) -> float | None:
        a, b = self.median_us.get(variant), self.median_us.get(to)
        return None if a is None or not b else a / b


class Sync:
    """Wall-clock step timing that waits for an accelerator before reading the clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def outlines_model(tokenizer: Any) -> Any:
    """An outlines Transformers model over *tokenizer*; the weights are never run here."""
    import outlines

    from outlines_maskcache.bench.material import tiny_model

    return outlines.from_transformers(tiny_model(tokenizer), tokenizer)


def processor_factories(model: Any, grammar: str) -> dict[str, Callable[[], Any]]:
    """One constructor per backend; each call builds a fresh processor as outlines would."""
    from outlines import backends

    kind, spec = GRAMMARS[grammar]
    factories: dict[str, Callable[[], Any]] = {}
    for name, backend_name in (("outlines_core", "outlines_core"), ("xgrammar", "xgrammar"), ("llguidance", "llguidance")):
        getter = backends.get_json_schema_logits_processor if kind == "json" else backends.get_regex_logits_processor
        factories[name] = lambda getter=getter, backend_name=backend_name: getter(backend_name, model, spec)
    return factories


def logits_pool(batch: int, width: int, device: torch.device, size: int = 4, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, width, generator=gen).to(device) for _ in range(size)]


def decode(processor: Any, pool: list[torch.Tensor], steps: int, clock: Sync) -> Iterator[float]:
    """Greedy decode over the logits pool; yields each step's processor time in seconds."""
    batch = pool[0].shape[0]
    device = pool[0].device
    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
    for step in range(steps):
        logits = pool[step % len(pool)].clone()
        t0 = clock()
        out = processor(ids, logits)
        t1 = clock()
        yield t1 - t0
        nxt = out.argmax(dim=-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)


def floor_steps(pool: list[torch.Tensor], steps: int, clock: Sync) -> Iterator[float]:
    mask = torch.zeros_like(pool[0])
    for step in range(steps):
        logits = pool[step % len(pool)].clone()
        t0 = clock()
        logits.add_(mask)
        yield clock() - t0


def run_case(model: Any, tokenizer_name: str, grammar: str, batch: int, steps: int, repeats: int,
             device: torch.device, variants: tuple[str, ...], progress: Callable[[], None] | None = None) -> Case:
    width = int(model.model.config.vocab_size) if hasattr(model.model, "config") else len(model.tokenizer.tokenizer)
    pool = logits_pool(batch, width, device)
    clock = Sync(device)
    factories = processor_factories(model, grammar)
    samples: dict[str, list[float]] = {v: [] for v in variants}

    def stock_proc() -> Any:
        with mc.disabled():
            return factories["outlines_core"]()

    def one(variant: str) -> list[float]:
        if variant == "floor":
            return list(floor_steps(pool, steps, clock))
        if variant == "stock":
            proc = stock_proc()
            with mc.disabled():
                return list(decode(proc, pool, steps, clock))
        if variant.startswith("cached"):
            if variant == "cached-cold":
                mc.clear()
            proc = factories["outlines_core"]()
            return list(decode(proc, pool, steps, clock))
        proc = factories[variant]()
        return list(decode(proc, pool, steps, clock))

    # Warm-up: compile stock's torch kernel, fill the cache for cached-warm,
    # and find out which optional backends are installed.
    available = []
    for variant in variants:
        try:
            one(variant)
            available.append(variant)
        except ImportError:
            continue
    for _ in range(repeats):
        for variant in available:
            step_times = one(variant)
            # The first step of a fresh processor sets up guides: report it
            # apart (compile-time figures), time steps 1.. as the decode loop.
            samples[variant].extend(step_times[1:])
            if progress:
                progress()
    case = Case(tokenizer_name, grammar, batch, width)
    case.median_us = {v: statistics.median(s) * 1e6 for v, s in samples.items() if s}
    return case


def run(tokenizers: list[str], grammars: list[str], batches: list[int], steps: int, repeats: int,
        device: str = "cpu", variants: tuple[str, ...] = VARIANTS, progress_factory: Callable[[int], Callable[[], None]] | None = None) -> list[Case]:
    from outlines_maskcache.bench.material import tokenizer as load_tokenizer

    dev = torch.device(device)
    total = len(tokenizers) * len(grammars) * len(batches) * repeats * len(variants)
    progress = progress_factory(total) if progress_factory else None
    cases = []
    for name in tokenizers:
        model = outlines_model(load_tokenizer(name))
        if dev.type != "cpu":
            model.model.to(dev)
        for grammar in grammars:
            for batch in batches:
                cases.append(run_case(model, name, grammar, batch, steps, repeats, dev, variants, progress))
    return cases


def as_json(cases: list[Case]) -> list[dict[str, Any]]:
    return [asdict(c) | {"ratios": {
        "cached_warm_over_floor": c.ratio("cached-warm", "floor"),
        "stock_over_cached_warm": c.ratio("stock", "cached-warm"),
    }} for c in cases]
