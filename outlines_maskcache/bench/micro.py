"""Per-step processor time: stock outlines_core vs cached (cold, warm) vs xgrammar/llguidance vs the floor.

Every variant decodes over the same stream of random logits, so the cached
and stock variants walk the same paths (their masks are identical); rows get
different logits and so sit in different states.  Two walks: ``greedy``
(argmax of the masked logits) and ``random`` (a seeded draw from the masked
distribution, so rows keep moving between states).  Repeats are interleaved
variant by variant, so machine noise hits all variants alike, and medians
are reported.

Two loops.  ``realistic`` (the default) is built like a decode loop: before
every step a sweep over twice the last-level cache evicts what the previous
step left there (as a model's forward pass does), then the step's logits are
freshly written.  Cached rows are then read from memory, not from cache, as
in a server.  ``hot`` leaves the caches alone: a micro-loop, flattering to
anything that keeps state between steps.  The floor, timed inside the same
loop on the same fresh logits, is one ``torch.minimum`` of the (B, V) logits
with a single broadcast (V,) row: the least any mask can cost.  ``floor-rows``
is the same op with a (B, V) operand (one row per batch row, swept out of
the cache like the cached rows): the least a mask costs when the rows of a
batch sit in different states and each needs its own row.
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
VARIANTS = ("floor", "floor-rows", "stock", "cached-cold", "cached-warm", "xgrammar", "llguidance")
LOOPS = ("realistic", "hot")
WALKS = ("greedy", "random")
#: bytes the realistic loop sweeps between steps: twice a large server L3
SWEEP_BYTES = 64 << 20


@dataclass
class Case:
    tokenizer: str
    grammar: str
    batch: int
    vocab: int
    loop: str = "realistic"
    walk: str = "greedy"
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


class Loop:
    """What happens between two timed steps: fresh logits, and in the realistic loop a cache sweep first."""

    def __init__(self, kind: str, batch: int, width: int, device: torch.device, pool_size: int = 4, seed: int = 0) -> None:
        if kind not in LOOPS:
            raise ValueError(f"loop must be one of {LOOPS}, not {kind!r}")
        gen = torch.Generator().manual_seed(seed)
        self.pool = [torch.randn(batch, width, generator=gen).to(device) for _ in range(pool_size)]
        self.sweep = torch.zeros(SWEEP_BYTES // 4, dtype=torch.float32) if kind == "realistic" else None
        self.clock = Sync(device)

    def logits(self, step: int) -> torch.Tensor:
        if self.sweep is not None:
            # A write over 64 MiB evicts the last-level cache (and so the
            # cached rows, the scratch buffers and the guides' tables), as
            # a forward pass's weight traffic does between decoding steps.
            self.sweep.add_(1.0)
        return self.pool[step % len(self.pool)].clone()


def next_tokens(masked: torch.Tensor, walk: str, gen: torch.Generator) -> torch.Tensor:
    """Each row's next token: argmax, or a seeded draw from the masked distribution."""
    if walk == "greedy":
        return masked.argmax(dim=-1, keepdim=True)
    probs = torch.softmax(masked.float().cpu(), dim=-1)
    return torch.multinomial(probs, 1, generator=gen).to(masked.device)


def decode(processor: Any, loop: Loop, steps: int, walk: str = "greedy", seed: int = 0) -> Iterator[float]:
    """Decode over the loop's logits; yields each step's processor time in seconds."""
    batch, device = loop.pool[0].shape[0], loop.pool[0].device
    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
    gen = torch.Generator().manual_seed(seed)
    clock = loop.clock
    for step in range(steps):
        logits = loop.logits(step)
        t0 = clock()
        out = processor(ids, logits)
        t1 = clock()
        yield t1 - t0
        ids = torch.cat([ids, next_tokens(out, walk, gen)], dim=1)


def floor_steps(loop: Loop, steps: int, per_row: bool = False) -> Iterator[float]:
    """The bare op on the same fresh logits: one ``minimum`` with a broadcast (V,) row, or a (B, V) operand."""
    pool = loop.pool[0]
    row = torch.full(pool.shape if per_row else pool.shape[1:], float("inf"), dtype=pool.dtype, device=pool.device)
    row[..., ::7] = -float("inf")
    clock = loop.clock
    for step in range(steps):
        logits = loop.logits(step)
        t0 = clock()
        torch.minimum(logits, row, out=logits)
        yield clock() - t0


def run_case(model: Any, tokenizer_name: str, grammar: str, batch: int, steps: int, repeats: int,
             device: torch.device, variants: tuple[str, ...], progress: Callable[[], None] | None = None,
             loop_kind: str = "realistic", walk: str = "greedy") -> Case:
    width = int(model.model.config.vocab_size) if hasattr(model.model, "config") else len(model.tokenizer.tokenizer)
    loop = Loop(loop_kind, batch, width, device)
    factories = processor_factories(model, grammar)
    samples: dict[str, list[float]] = {v: [] for v in variants}

    def stock_proc() -> Any:
        with mc.disabled():
            return factories["outlines_core"]()

    def one(variant: str) -> list[float]:
        if variant in ("floor", "floor-rows"):
            return list(floor_steps(loop, steps, per_row=variant == "floor-rows"))
        if variant == "stock":
            proc = stock_proc()
            with mc.disabled():
                return list(decode(proc, loop, steps, walk))
        if variant.startswith("cached"):
            if variant == "cached-cold":
                mc.clear()
            proc = factories["outlines_core"]()
            return list(decode(proc, loop, steps, walk))
        proc = factories[variant]()
        return list(decode(proc, loop, steps, walk))

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
    case = Case(tokenizer_name, grammar, batch, width, loop_kind, walk)
    case.median_us = {v: statistics.median(s) * 1e6 for v, s in samples.items() if s}
    return case


def run(tokenizers: list[str], grammars: list[str], batches: list[int], steps: int, repeats: int,
        device: str = "cpu", variants: tuple[str, ...] = VARIANTS,
        progress_factory: Callable[[int], Callable[[], None]] | None = None,
        loop: str = "realistic", walks: tuple[str, ...] = WALKS) -> list[Case]:
    from outlines_maskcache.bench.material import tokenizer as load_tokenizer

    dev = torch.device(device)
    total = len(tokenizers) * len(grammars) * len(batches) * len(walks) * repeats * len(variants)
    progress = progress_factory(total) if progress_factory else None
    cases = []
    for name in tokenizers:
        model = outlines_model(load_tokenizer(name))
        if dev.type != "cpu":
            model.model.to(dev)
        for grammar in grammars:
            for walk in walks:
                for batch in batches:
                    cases.append(run_case(model, name, grammar, batch, steps, repeats, dev, variants, progress,
                                          loop, walk))
    return cases


def as_json(cases: list[Case]) -> list[dict[str, Any]]:
    return [asdict(c) | {"ratios": {
        "cached_warm_over_floor": c.ratio("cached-warm", "floor"),
        "cached_warm_over_floor_rows": c.ratio("cached-warm", "floor-rows"),
        "stock_over_cached_warm": c.ratio("stock", "cached-warm"),
    }} for c in cases]
