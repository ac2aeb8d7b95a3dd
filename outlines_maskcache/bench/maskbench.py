"""MaskBench, replayed: ``outlines-maskcache bench maskbench``.

MaskBench (guidance-ai/jsonschemabench) is how the constrained-decoding
field compares mask engines: for each real JSON schema it compiles the
grammar (TTFM, time to first mask), then replays each valid and invalid
instance, serialised with ``json.dumps`` and tokenized with the Llama-3
tokenizer, token by token, timing every mask (TBM).  A valid instance an
engine rejects is a validation error; an invalid one it accepts to the end
is an invalidation error.

Engines, interleaved per schema in one run:

* ``outlines``: stock outlines_core, ``Guide.write_mask_into`` into an int32 bitmask;
* ``maskcache``: the cached bitmask row (the vLLM target's path), cold
  (cache and store empty: the first pass), ``maskcache-warm`` (a second
  pass) and ``maskcache-stored`` (a fresh process with a warm store: the
  in-process cache dropped, rows loaded from the store's persisted masks);
* ``maskcache-lazy``: a never-seen schema as the product serves it with the
  lazy Index on (#29): TTFM from the regex to the first mask (byte-level
  Index and the first state's row, the vocabulary's token table ready, as a
  stored vocabulary has it); TBM over a cold cache, each new state's row
  computed on its first visit.  A schema the lazy Index refuses pays the
  refusal plus stock's compile, as the product does;
* ``outlines-logits`` / ``maskcache-logits``: outlines 1.x's logits
  processor step at B=1 on fp32 logits, stock vs cached;
* ``llguidance`` and ``xgrammar``: their matchers filling the same bitmask,
  on the same schemas (those outlines_core compiled).

Conformance is checked on the way, at every token: the cached bitmask equals
stock's bit for bit, the cached logits equal stock's, and stock and cached
accept and reject the same tokens.  Compiles run in guarded worker processes
(time limit and memory cap; timeouts and out-of-memory are counted as
MaskBench counts them) and go through the grammar store.
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from outlines_maskcache.ahead_of_time import Grammar, read_grammars

#: MaskBench's percentiles
TBM_POINTS = (25, 50, 75, 90, 95, 99, 99.9)
TTFM_POINTS = (50, 75, 90, 99)
ENGINES = ("outlines", "maskcache", "maskcache-warm", "maskcache-stored", "maskcache-lazy", "outlines-logits",
           "maskcache-logits", "llguidance", "xgrammar")
ENV_DATA = "MASKBENCH_DATA"


def default_data_dir() -> Path | None:
    """``$MASKBENCH_DATA``, else the project's ``../shared/maskbench``, else the vendored sample in tests/data."""
    here = Path(__file__).resolve().parents[2]
    for candidate in (os.environ.get(ENV_DATA), here.parent / "shared" / "maskbench", here / "tests" / "data" / "maskbench"):
        if candidate and Path(candidate).is_dir() and any(Path(candidate).glob("*.json")):
            return Path(candidate)
    return None


def load_dataset(data: str | os.PathLike[str] | None = None, limit: int | None = None,
                 with_tests: bool = True) -> list[Grammar]:
    root = Path(data) if data else default_data_dir()
    if root is None:
        raise FileNotFoundError(f"no MaskBench data: pass --data DIR or set {ENV_DATA}")
    found = [g for g in read_grammars([root]) if g.tests or not with_tests]
    return found[:limit] if limit else found


def sample(grammars: list[Grammar], n: int) -> list[Grammar]:
    """A fixed, evenly spread sample of *n* (sorted by name, so every run picks the same)."""
    ordered = sorted(grammars, key=lambda g: g.name)
    if n >= len(ordered):
        return ordered
    step = len(ordered) / n
    return [ordered[int(i * step)] for i in range(n)]


def sample_that_compiles(grammars: list[Grammar], n: int, vocabulary: Any, vocab_key: str, *, timeout: float,
                         max_bytes: int, workers: int = 1, keep_index: bool = False) -> tuple[list, list]:
    """*n* grammars that compile within the caps: (compiled, failed), each a list of (grammar, Outcome).

    The evenly spread :func:`sample` first (names sort by tool, so the first
    *n* would be one tool's variants), then the rest in their order as
    replacements for those that time out, run out of memory or are
    unsupported.  Each round compiles, in guarded workers, only as many as
    are still missing.
    """
    from outlines_maskcache.ahead_of_time import compile_all

    spread = sample(grammars, n)
    taken = {id(g) for g in spread}
    candidates = spread + [g for g in grammars if id(g) not in taken]
    compiled: list = []
    failed: list = []
    start = 0
    while len(compiled) < n and start < len(candidates):
        chunk = candidates[start:start + n - len(compiled)]
        start += len(chunk)
        report = compile_all(chunk, vocabulary, vocab_key, workers=workers, timeout=timeout, max_bytes=max_bytes,
                             keep_index=keep_index)
        for grammar, outcome in zip(chunk, report.outcomes):
            (compiled if outcome.status in ("compiled", "stored") else failed).append((grammar, outcome))
    return compiled, failed


@dataclass
class Tally:
    tbm_us: list[float] = field(default_factory=list)
    ttfm_us: list[float] = field(default_factory=list)
    passing: int = 0
    validation_errors: int = 0
    invalidation_errors: int = 0


@dataclass
class Result:
    tokenizer: str
    engines: dict[str, Tally]
    schemas: int = 0
    compile_status: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    #: conformance: cached vs stock, per check
    checked_tokens: int = 0
    disagreements: dict[str, int] = field(default_factory=lambda: {"bitmask": 0, "logits": 0, "accept": 0})
    examples: list[str] = field(default_factory=list)
    #: schemas llguidance / xgrammar could not compile
    external_errors: dict[str, int] = field(default_factory=dict)
    #: schemas the lazy engine served lazily, and those it refused (then compiled in full)
    lazy: dict[str, int] = field(default_factory=lambda: {"served": 0, "refused": 0})

    def conformant(self) -> bool:
        return not any(self.disagreements.values())


def percentiles(values: list[float], points: tuple[float, ...]) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values)
    out = {"avg": float(arr.mean())}
    out.update({f"p{p:g}": float(np.percentile(arr, p)) for p in points})
    out["max"] = float(arr.max())
    return out


class _Words:
    """Bitmask helpers shared by the engines: allowed-bit reads and the cached row of a state."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.n_words = (width + 31) // 32

    @staticmethod
    def allows(words: np.ndarray, token: int) -> bool:
        return bool((int(words[token >> 5]) >> (token & 31)) & 1)


def _replay_outlines(index: Any, tokens: list[int], words: np.ndarray, tally: Tally | None) -> tuple[int, list[np.ndarray]]:
    """Stock outlines_core: returns (tokens accepted, the bitmask at each step)."""
    from outlines_core import Guide

    guide = Guide(index)
    masks = []
    for i, token in enumerate(tokens):
        t0 = time.perf_counter()
        guide.write_mask_into(words.ctypes.data, words.size, words.itemsize)
        t1 = time.perf_counter()
        if tally is not None:
            tally.tbm_us.append((t1 - t0) * 1e6)
        masks.append(words.copy())
        if not _Words.allows(words, token):
            return i, masks
        guide.advance(token, False)
    return len(tokens), masks


def _finished(index: Any, tokens: list[int]) -> bool:
    from outlines_core import Guide

    guide = Guide(index)
    try:
        for token in tokens:
            guide.advance(token, False)
    except ValueError:  # a token the grammar rejects: not a complete instance
        return False
    return guide.is_finished()


def _replay_maskcache(index: Any, fingerprint: str, tokens: list[int], bitmask: np.ndarray,
                      tally: Tally | None) -> tuple[int, list[np.ndarray]]:
    """The cached bitmask row, copied into the batch bitmask as the vLLM target does."""
    from outlines_core import Guide

    from outlines_maskcache.lazy_index import LazyGuide, LazyIndex
    from outlines_maskcache.rows import bitmask_row

    guide = LazyGuide(index) if isinstance(index, LazyIndex) else Guide(index)
    masks = []
    n_words = bitmask.shape[1]
    for i, token in enumerate(tokens):
        t0 = time.perf_counter()
        bitmask[0] = bitmask_row(fingerprint, guide, n_words)
        t1 = time.perf_counter()
        if tally is not None:
            tally.tbm_us.append((t1 - t0) * 1e6)
        masks.append(bitmask[0].copy())
        if not _Words.allows(bitmask[0], token):
            return i, masks
        guide.advance(token, False)
    return len(tokens), masks


def _replay_logits(index: Any, tokens: list[int], width: int, cached: bool, tally: Tally | None) -> tuple[int, list[Any]]:
    """outlines 1.x's processor at B=1: one fresh fp32 logits row per step, stock or cached."""
    import torch
    from outlines.backends.outlines_core import OutlinesCoreLogitsProcessor

    import outlines_maskcache as mc

    processor = OutlinesCoreLogitsProcessor(index, "torch")
    ids = torch.zeros((1, 1), dtype=torch.long)
    outs = []
    for i, token in enumerate(tokens):
        logits = torch.zeros((1, width), dtype=torch.float32)
        if cached:
            t0 = time.perf_counter()
            out = processor(ids, logits)
            t1 = time.perf_counter()
        else:
            with mc.disabled():
                t0 = time.perf_counter()
                out = processor(ids, logits)
                t1 = time.perf_counter()
        if tally is not None:
            tally.tbm_us.append((t1 - t0) * 1e6)
        row = out[0]
        outs.append(hashlib.sha256(row.numpy().tobytes()).digest())  # exact content, without holding 512 KiB a token
        if not bool(torch.isfinite(row[token])):
            return i, outs
        ids = torch.tensor([[token]], dtype=torch.long)
    return len(tokens), outs


class _Llguidance:
    def __init__(self, hf_tokenizer: Any, width: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.ll = llguidance
        self.tok = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=width)
        self.fill = llguidance.numpy.fill_next_token_bitmask
        self.bitmask = llguidance.numpy.allocate_token_bitmask(1, self.tok.vocab_size)

    def compile(self, grammar: Grammar) -> Any:
        if grammar.kind == "json":
            # Flexible whitespace: instances are json.dumps'ed with ", " and ": " (outlines' default allows them too).
            return self.ll.LLMatcher.grammar_from_json_schema(grammar.spec, defaults={"whitespace_flexible": True})
        return self.ll.LLMatcher.grammar_from_regex(grammar.spec)

    def replay(self, compiled_grammar: Any, tokens: list[int], tally: Tally) -> tuple[int, bool]:
        matcher = self.ll.LLMatcher(self.tok, compiled_grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        for i, token in enumerate(tokens):
            t0 = time.perf_counter()
            self.fill(matcher, self.bitmask, 0)
            tally.tbm_us.append((time.perf_counter() - t0) * 1e6)
            if not _Words.allows(self.bitmask[0], token) or not matcher.consume_token(token):
                return i, False
        return len(tokens), matcher.is_accepting()


class _Xgrammar:
    def __init__(self, hf_tokenizer: Any, width: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=width)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.bitmask = xgr.allocate_token_bitmask(1, width)

    def compile(self, grammar: Grammar) -> Any:
        if grammar.kind == "json":
            return self.compiler.compile_json_schema(grammar.spec, any_whitespace=True)
        return self.compiler.compile_regex(grammar.spec)

    def replay(self, compiled_grammar: Any, tokens: list[int], tally: Tally) -> tuple[int, bool]:
        matcher = self.xgr.GrammarMatcher(compiled_grammar)
        words = self.bitmask.numpy()
        for i, token in enumerate(tokens):
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(self.bitmask)
            tally.tbm_us.append((time.perf_counter() - t0) * 1e6)
            if not _Words.allows(words[0], token) or not matcher.accept_token(token):
                return i, False
        return len(tokens), bool(matcher.is_completed())


def _judge(tally: Tally, valid: bool, accepted_all: bool) -> None:
    if valid and not accepted_all:
        tally.validation_errors += 1
    elif not valid and accepted_all:
        tally.invalidation_errors += 1
    else:
        tally.passing += 1


def run(data: str | None = None, tokenizer_name: str = "llama3", limit: int | None = None,
        engines: tuple[str, ...] = ENGINES, timeout: float = 60.0, max_bytes: int = 8 << 30, workers: int = 1,
        check: bool = True, grammars: list[Grammar] | None = None,
        progress: Callable[..., None] | None = None) -> Result:
    """Compile and replay every schema; *progress* is called once per schema."""
    import outlines_maskcache as mc
    from outlines_core import Index

    from outlines_maskcache.bench.material import tokenizer as load_tokenizer
    from outlines_maskcache.compiled import store_key
    from outlines_maskcache.ahead_of_time import compile_all, outlines_vocabulary
    from outlines_maskcache.runtime import RUNTIME

    unknown = set(engines) - set(ENGINES)
    if unknown:
        raise ValueError(f"unknown engines {sorted(unknown)}; choose from {ENGINES}")
    hf = load_tokenizer(tokenizer_name) if tokenizer_name in ("llama3", "gpt2") else _tokenizer_from_path(tokenizer_name)
    grammars = grammars if grammars is not None else load_dataset(data, limit)
    width = len(hf)
    vocabulary, vocab_key = outlines_vocabulary(hf)
    result = Result(tokenizer_name, {e: Tally() for e in engines}, schemas=len(grammars))
    for status in ("compiled", "timeout", "oom", "error", "crash"):
        result.compile_status[status] = 0
    externals = {name: cls(hf, width) for name, cls in (("llguidance", _Llguidance), ("xgrammar", _Xgrammar))
                 if name in engines}
    table = _token_table(vocabulary) if "maskcache-lazy" in engines else None
    words = np.empty(_Words(width).n_words, dtype=np.int32)
    bitmask = np.empty((1, _Words(width).n_words), dtype=np.int32)
    if "outlines-logits" in engines or "maskcache-logits" in engines or check:
        _warm_up_processors(vocabulary, width)
    store = RUNTIME.store()
    store_setting = mc.settings().store
    chunk = max(4, 2 * workers)  # compiled Indexes are held for one chunk only (some are 100s of MB)
    for first in range(0, len(grammars), chunk):
        part = grammars[first:first + chunk]
        # TTFM: stock's compile in guarded workers (the store is bypassed for the timing).
        mc.configure(store=False)
        try:
            report = compile_all(part, vocabulary, vocab_key, workers=workers, timeout=timeout, max_bytes=max_bytes,
                                 keep_index=True)
        finally:
            mc.configure(store=store_setting)
        for grammar, outcome in zip(part, report.outcomes):
            result.compile_status[outcome.status] += 1
            if outcome.status == "compiled" and outcome.index is not None:
                index = Index.from_binary(outcome.index)
                for engine in ("outlines", "maskcache", "outlines-logits", "maskcache-logits"):
                    if engine in engines:
                        result.engines[engine].ttfm_us.append(outcome.seconds * 1e6)
                if store is not None and ("maskcache-warm" in engines or "maskcache-stored" in engines):
                    # What the next process pays instead of the compile: a verified load from the store.
                    key = store_key("index", vocab_key, outcome.regex)
                    store.put(key, outcome.index)
                    t0 = time.perf_counter()
                    Index.from_binary(store.get(key) or b"")
                    for engine in ("maskcache-warm", "maskcache-stored"):
                        if engine in engines:
                            result.engines[engine].ttfm_us.append((time.perf_counter() - t0) * 1e6)
                outcome.index = None
                _replay_schema(result, grammar, index, hf, width, engines, check, words, bitmask, vocab_key)
                if table is not None:
                    _replay_lazy(result, grammar, outcome.regex, outcome.seconds, vocabulary, table, index, hf, check,
                                 bitmask, vocab_key)
                # The other engines on the same schemas (those outlines compiled), so every TBM row covers one set.
                for name, engine in externals.items():
                    _replay_external(result, name, engine, grammar, hf)
            if progress:
                progress()
    return result


def _warm_up_processors(vocabulary: Any, width: int) -> None:
    """Stock's first processor call in a process compiles its unpack kernel (seconds): a one-off, not a mask."""
    from outlines_core import Index

    index = Index(r"[0-9]{1,3}", vocabulary)
    for cached in (False, True):
        _replay_logits(index, [15, 16], width, cached, None)


def _instances(grammar: Grammar, hf: Any) -> list[tuple[bool, list[int]]]:
    return [(valid, hf.encode(json.dumps(value), add_special_tokens=False)) for valid, value in grammar.tests]


def _replay_schema(result: Result, grammar: Grammar, index: Any, hf: Any, width: int, engines: tuple[str, ...],
                   check: bool, words: np.ndarray, bitmask: np.ndarray, vocab_key: str) -> None:
    """Every pass over all of the schema's instances, in order: stock, cold, warm, stored, then the processors.

    Pass by pass (not instance by instance) so each pass sees the schema as
    a process would: the cold pass starts with nothing cached, the stored
    pass with nothing in memory and the rows the earlier passes persisted.
    """
    import outlines_maskcache as mc
    from outlines_maskcache.persisted_masks import PERSISTED
    from outlines_maskcache.runtime import RUNTIME

    instances = _instances(grammar, hf)
    complete = [_finished(index, tokens) for _, tokens in instances]
    # Stock first: its masks are the reference every cached pass is compared with.
    reference = []
    for (valid, tokens), done in zip(instances, complete):
        result.tokens += len(tokens)
        tally = result.engines.get("outlines")
        n, masks = _replay_outlines(index, tokens, words, tally)
        reference.append((n, masks))
        result.checked_tokens += n
        if tally is not None:
            _judge(tally, valid, n == len(tokens) and done)
    # A name no earlier run persisted rows under: the cold pass starts from
    # an empty cache *and* an empty store.
    fingerprint = f"maskbench:{grammar.name}:{vocab_key}:{os.getpid()}:{time.time_ns()}"
    mc.clear()
    for engine in ("maskcache", "maskcache-warm", "maskcache-stored"):
        tally = result.engines.get(engine)
        if tally is None and not check:
            continue
        if engine == "maskcache-stored":
            if RUNTIME.store() is None:
                continue
            PERSISTED.save_all()  # what this process learned, as it would at exit
            mc.clear()  # a fresh process: nothing in memory, the store warm
            t0 = time.perf_counter()  # loading the persisted rows belongs to the first mask's setup
            PERSISTED.grammar(fingerprint, bitmask.shape[1])
            if tally is not None and tally.ttfm_us:
                tally.ttfm_us[-1] += (time.perf_counter() - t0) * 1e6
        for (valid, tokens), done, (stock_n, stock_masks) in zip(instances, complete, reference):
            n, masks = _replay_maskcache(index, fingerprint, tokens, bitmask, tally)
            if tally is not None:
                _judge(tally, valid, n == len(tokens) and done)
            if check:
                _compare(result, grammar.name, engine, stock_n, stock_masks, n, masks, np.array_equal)
    if not (check or "outlines-logits" in engines or "maskcache-logits" in engines):
        return
    for (valid, tokens), done, (stock_n, _) in zip(instances, complete, reference):
        outs = {}
        for engine, cached in (("outlines-logits", False), ("maskcache-logits", True)):
            tally = result.engines.get(engine)
            outs[cached] = _replay_logits(index, tokens, width, cached, tally)
            if tally is not None:
                _judge(tally, valid, outs[cached][0] == len(tokens) and done)
        if check:
            if outs[False][0] != stock_n:
                _disagree(result, grammar.name, "accept", f"stock logits stop at {outs[False][0]}, bitmask at {stock_n}")
            _compare(result, grammar.name, "logits", outs[False][0], outs[False][1], outs[True][0], outs[True][1],
                     operator.eq)


def _token_table(vocabulary: Any) -> Any:
    from outlines_maskcache import outlines_core_calls as core
    from outlines_maskcache.lazy_index import TokenTable

    return TokenTable.of(*core.vocabulary_tokens(vocabulary)) if core.has_python_index() else None


def _replay_lazy(result: Result, grammar: Grammar, regex: str, compile_seconds: float, vocabulary: Any, table: Any,
                 index: Any, hf: Any, check: bool, bitmask: np.ndarray, vocab_key: str) -> None:
    """The lazy engine's pass: first mask from the regex, then every instance on a cold cache, checked against stock."""
    import outlines_maskcache as mc
    from outlines_maskcache import outlines_core_calls as core
    from outlines_maskcache.lazy_index import LazyGuide, NotExact
    from outlines_maskcache.rows import bitmask_row

    tally = result.engines["maskcache-lazy"]
    mc.clear()
    fingerprint = f"maskbench-lazy:{grammar.name}:{vocab_key}:{os.getpid()}:{time.time_ns()}"
    t0 = time.perf_counter()
    try:
        served: Any = core.lazy_index(regex, vocabulary, table)
        bitmask[0] = bitmask_row(fingerprint, LazyGuide(served), bitmask.shape[1])
        tally.ttfm_us.append((time.perf_counter() - t0) * 1e6)
        result.lazy["served"] += 1
    except NotExact:  # the product compiles in full: the refusal, then stock's compile, before the first mask
        tally.ttfm_us.append((time.perf_counter() - t0 + compile_seconds) * 1e6)
        result.lazy["refused"] += 1
        served = index
    for valid, tokens in _instances(grammar, hf):
        n, masks = _replay_maskcache(served, fingerprint, tokens, bitmask, tally)
        _judge(tally, valid, n == len(tokens) and _finished(index, tokens))
        if check:
            stock_n, stock_masks = _replay_outlines(index, tokens, np.empty_like(bitmask[0]), None)
            _compare(result, grammar.name, "maskcache-lazy", stock_n, stock_masks, n, masks, np.array_equal)


def _replay_external(result: Result, name: str, engine: Any, grammar: Grammar, hf: Any) -> None:
    tally = result.engines[name]
    try:
        t0 = time.perf_counter()
        compiled_grammar = engine.compile(grammar)
        tally.ttfm_us.append((time.perf_counter() - t0) * 1e6)
    except Exception:  # noqa: BLE001 - a schema the engine cannot take is its compile error
        result.external_errors[name] = result.external_errors.get(name, 0) + 1
        return
    for valid, tokens in _instances(grammar, hf):
        try:
            n, accepting = engine.replay(compiled_grammar, tokens, tally)
        except Exception:  # noqa: BLE001
            n, accepting = -1, False
        _judge(tally, valid, n == len(tokens) and accepting)


def _compare(result: Result, name: str, what: str, stock_n: int, stock: list[Any], n: int, got: list[Any],
             equal: Callable[[Any, Any], bool]) -> None:
    if n != stock_n:
        _disagree(result, name, "accept", f"{what}: cached stops at token {n}, stock at {stock_n}")
    for i, (a, b) in enumerate(zip(stock, got)):
        if not equal(a, b):
            _disagree(result, name, "logits" if what == "logits" else "bitmask", f"{what}: mask differs at token {i}")
            return


def _disagree(result: Result, name: str, what: str, detail: str) -> None:
    result.disagreements[what] += 1
    if len(result.examples) < 20:
        result.examples.append(f"{name}: {detail}")


def _tokenizer_from_path(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def as_json(result: Result) -> dict[str, Any]:
    return {
        "tokenizer": result.tokenizer,
        "schemas": result.schemas,
        "tokens": result.tokens,
        "compile": result.compile_status,
        "external_compile_errors": result.external_errors,
        "lazy_index": result.lazy,
        "conformance": {"checked_tokens": result.checked_tokens, "disagreements": result.disagreements,
                        "examples": result.examples},
        "engines": {name: {"tbm_us": percentiles(t.tbm_us, TBM_POINTS), "ttfm_us": percentiles(t.ttfm_us, TTFM_POINTS),
                           "masks": len(t.tbm_us), "passing": t.passing, "validation_errors": t.validation_errors,
                           "invalidation_errors": t.invalidation_errors}
                    for name, t in result.engines.items()},
    }


def print_result(result: Result, markdown: bool = False) -> None:
    from outlines_maskcache.bench.report import table

    data = as_json(result)
    tbm_cols = ["avg", *(f"p{p:g}" for p in TBM_POINTS), "max"]
    ttfm_cols = ["avg", *(f"p{p:g}" for p in TTFM_POINTS)]
    rows_tbm = [[name] + [f"{e['tbm_us'].get(c, float('nan')):,.1f}" for c in tbm_cols] for name, e in data["engines"].items()]
    rows_ttfm = [[name] + [f"{e['ttfm_us'].get(c, float('nan')) / 1000:,.1f}" for c in ttfm_cols]
                 + [f"{e['masks']:,}", str(e["passing"]), str(e["validation_errors"]), str(e["invalidation_errors"])]
                 for name, e in data["engines"].items()]
    headers_tbm = ["engine", *(f"TBM {c} µs" for c in tbm_cols)]
    headers_ttfm = ["engine", *(f"TTFM {c} ms" for c in ttfm_cols), "masks", "passing", "validation err", "invalidation err"]
    if markdown:
        for headers, rows in ((headers_tbm, rows_tbm), (headers_ttfm, rows_ttfm)):
            print("| " + " | ".join(headers) + " |")
            print("|" + "---|" * len(headers))
            for row in rows:
                print("| " + " | ".join(row) + " |")
            print()
    else:
        table(f"MaskBench TBM ({result.tokenizer})", headers_tbm, rows_tbm)
        table("MaskBench TTFM and counts", headers_ttfm, rows_ttfm)
    c = data["compile"]
    print(f"schemas {data['schemas']}: compiled {c.get('compiled', 0)}, compile error {c.get('error', 0)}, "
          f"timeout {c.get('timeout', 0)}, out of memory {c.get('oom', 0)}, crashed {c.get('crash', 0)}; "
          f"tokens {data['tokens']:,}")
    d = data["conformance"]
    if "maskcache-lazy" in data["engines"]:
        print(f"lazy Index: {data['lazy_index']['served']} schemas served lazily, "
              f"{data['lazy_index']['refused']} refused (compiled in full)")
    if data["external_compile_errors"]:
        print(f"schemas the other engines could not compile: {data['external_compile_errors']}")
    print(f"conformance: {d['checked_tokens']:,} tokens checked, disagreements {d['disagreements']}")
    for line in d["examples"]:
        print("  ", line)


def plot_cdf(result: Result, path: str | os.PathLike[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, tally in result.engines.items():
        if tally.tbm_us:
            xs = np.sort(np.asarray(tally.tbm_us))
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=name)
    ax.set_xscale("log")
    ax.set_xlabel("time per mask (µs, log)")
    ax.set_ylabel("fraction of masks")
    ax.set_title(f"MaskBench TBM CDF ({result.tokenizer}, {result.schemas} schemas)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
