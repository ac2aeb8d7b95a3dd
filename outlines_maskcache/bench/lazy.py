"""``bench lazy``: a never-seen schema's first mask, stock's full compile against the lazy Index (#29).

Per schema of a fixed MaskBench sample, interleaved in one process:

* **stock**: the schema's regex, ``Index(regex, vocabulary)``, a ``Guide``
  and its first ``write_mask_into``: what outlines pays before the first
  mask of a new schema.
* **lazy**: the same regex, the byte-level Index, the
  :class:`~outlines_maskcache.lazy_index.LazyIndex` (refused where it cannot
  be proven equal) and the first state's row packed into the same bitmask.
* **whole instance**: each side plus masking the schema's first valid
  instance token by token (stock: ``write_mask_into`` and ``advance``;
  lazy: each new state's row on first visit).
* **llguidance** (when installed): grammar compile, matcher and first fill.

Equality is checked on the way: every state of every Index stock compiled
(walked from its start) against the lazy rows, allowed tokens in full and
next states on a spread of tokens that reaches every next state, and the
first masks bit for bit.  Schemas whose stock compile times out or runs out of memory in the
guarded worker are tried lazily in a forked process under the same time
limit; one counts as rescued when it serves first masks and accepts each
of its MaskBench instances exactly when Python's ``re`` matches the
instance's text against outlines' regex (labels are reported beside).  The vocabulary's token
table (built once per vocabulary) is timed on its own, and both sides are
warmed up once on a toy regex before the first schema.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from outlines_maskcache.ahead_of_time import Grammar

#: next states compared per state in ``bench lazy`` (allowed tokens are compared in full)
NEXT_STATES_PER_STATE = 64


@dataclass
class Result:
    tokenizer: str
    schemas: int
    table_seconds: float = 0.0
    stock_status: dict[str, int] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)
    stock_ttfm_ms: list[float] = field(default_factory=list)
    lazy_ttfm_ms: list[float] = field(default_factory=list)
    llguidance_ttfm_ms: list[float] = field(default_factory=list)
    stock_instance_ms: list[float] = field(default_factory=list)
    lazy_instance_ms: list[float] = field(default_factory=list)
    per_schema: list[dict[str, Any]] = field(default_factory=list)
    states_checked: int = 0
    entries_checked: int = 0
    next_states_checked: int = 0
    differences: int = 0
    rescue_tried: int = 0
    rescued: int = 0
    rescue_failures: dict[str, int] = field(default_factory=dict)


def words_of_row(token_ids: np.ndarray, n_words: int) -> np.ndarray:
    """The int32 bitmask stock's ``write_mask_into`` writes for these allowed ids."""
    bits = np.zeros(n_words * 32, dtype=np.uint8)
    bits[token_ids] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def _first_valid(grammar: Grammar, hf: Any) -> list[int] | None:
    for valid, value in grammar.tests:
        if valid:
            return hf.encode(json.dumps(value), add_special_tokens=False)
    return None


def _stock(regex: str, vocabulary: Any, n_words: int, tokens: list[int] | None) -> tuple[float, float, Any, Any]:
    from outlines_core import Guide, Index

    words = np.empty(n_words, dtype=np.int32)
    t0 = time.perf_counter()
    index = Index(regex, vocabulary)
    guide = Guide(index)
    guide.write_mask_into(words.ctypes.data, n_words, 4)
    first = time.perf_counter() - t0
    first_words = words.copy()
    for token in tokens or []:
        guide.advance(token, return_tokens=False)
        guide.write_mask_into(words.ctypes.data, n_words, 4)
    return first, time.perf_counter() - t0, index, first_words


def _lazy(regex: str, table: Any, n_words: int, tokens: list[int] | None) -> tuple[float, float, Any, np.ndarray]:
    from outlines_maskcache import outlines_core_calls as core

    t0 = time.perf_counter()
    lazy = core.lazy_index(regex, None, table)  # as served: size guard, probe for states after a match
    state = lazy.initial_state
    words = words_of_row(lazy.row(state).token_ids, n_words)
    first = time.perf_counter() - t0
    masks = {state: words}  # as the mask cache keeps them: one bitmask per state, built on its first visit
    for token in tokens or []:
        state = lazy.next_state(state, token)
        if state is None:  # outlines' regex rejects this instance here (stock's guide would too)
            break
        if state not in masks:
            masks[state] = words_of_row(lazy.row(state).token_ids, n_words)
    return first, time.perf_counter() - t0, lazy, words


def _allowed_prefix(lazy: Any, tokens: list[int] | None) -> list[int] | None:
    """The instance's tokens up to the first one the Index rejects: what both sides mask."""
    if tokens is None:
        return None
    state = lazy.initial_state
    for n, token in enumerate(tokens):
        state = lazy.next_state(state, token)
        if state is None:
            return tokens[:n]
    return tokens


def _judge_lazily(regex: str, table: Any, instances: list[tuple[bool, str, list[int]]],
                  n_words: int) -> tuple[str, float, int]:
    """In a forked process: (verdict, seconds to the first mask, instances agreeing with their label).

    The oracle is the regex itself: each instance's text must be accepted
    exactly when Python's ``re.fullmatch`` of outlines' regex accepts it
    (outlines' conversion does not admit every instance MaskBench labels
    valid, and stock, had it compiled, would reject those too).  A regex
    Python cannot read has no oracle: then the MaskBench labels judge.
    """
    import re

    from outlines_maskcache.lazy_index import NotExact

    try:
        first, _, lazy, _ = _lazy(regex, table, n_words, None)
    except NotExact:
        return "refused", 0.0, 0
    try:
        oracle: Any = re.compile(regex)
    except re.error:
        oracle = None
    agree_with_label = 0
    for valid, text, tokens in instances:
        state: int | None = lazy.initial_state
        for token in tokens:
            state = lazy.next_state(state, token) if state is not None else None
        accepted = state is not None and lazy.is_final_state(state)
        agree_with_label += accepted == valid
        expected = valid if oracle is None else oracle.fullmatch(text) is not None
        if accepted != expected:
            return "wrong verdict", first, agree_with_label
    return "rescued", first, agree_with_label


def run(grammars: list[Grammar], tokenizer_name: str = "llama3", timeout: float = 30.0, max_bytes: int = 6 << 30,
        progress: Callable[[dict[str, Any]], None] | None = None) -> Result:
    """The comparison over ``grammars``; ``progress`` gets each schema's row as it is done (a long run streams them)."""
    import outlines_maskcache as mc
    from outlines_maskcache import outlines_core_calls as core
    from outlines_maskcache.ahead_of_time import compile_all, outlines_vocabulary
    from outlines_maskcache.bench.maskbench import _Llguidance
    from outlines_maskcache.bench.material import tokenizer as load_tokenizer
    from outlines_maskcache.lazy_index import TokenTable

    hf = load_tokenizer(tokenizer_name)
    width = len(hf)
    n_words = (width + 31) // 32
    vocabulary, vocab_key = outlines_vocabulary(hf)
    result = Result(tokenizer_name, len(grammars))
    t0 = time.perf_counter()
    table = TokenTable.of(*core.vocabulary_tokens(vocabulary))
    result.table_seconds = time.perf_counter() - t0
    # One-off process costs (numpy's first calls on these paths), as MaskBench warms processors up.
    _lazy("(ab|c)+[0-9]{1,3}", table, n_words, None)
    _stock("(ab|c)+[0-9]{1,3}", vocabulary, n_words, None)
    try:
        llg = _Llguidance(hf, width)
    except ImportError:
        llg = None
    store_setting = mc.settings().store
    mc.configure(store=False)  # every compile here is a first use
    try:
        for grammar in grammars:
            outcome = compile_all([grammar], vocabulary, vocab_key, timeout=timeout, max_bytes=max_bytes).outcomes[0]
            result.stock_status[outcome.status] = result.stock_status.get(outcome.status, 0) + 1
            row: dict[str, Any] = {"name": grammar.name, "stock": outcome.status}
            if outcome.status == "compiled" and outcome.regex is not None:
                _compare(result, row, grammar, outcome.regex, vocabulary, table, n_words, hf, llg)
            elif outcome.status in ("timeout", "oom") and grammar.kind == "json":
                _rescue(result, row, grammar, table, hf, timeout, n_words)
            result.per_schema.append(row)
            if progress:
                progress(row)
    finally:
        mc.configure(store=store_setting)
    return result


def _compare(result: Result, row: dict[str, Any], grammar: Grammar, regex: str, vocabulary: Any, table: Any,
             n_words: int, hf: Any, llg: Any) -> None:
    from outlines_maskcache import outlines_core_calls as core
    from outlines_maskcache.lazy_index import NotExact

    tokens = _first_valid(grammar, hf)
    t0 = time.perf_counter()
    regex_again = core.schema_regex(grammar.spec) if grammar.kind == "json" else grammar.spec
    conversion = time.perf_counter() - t0
    assert regex_again == regex
    try:
        lazy_first, lazy_whole, lazy, lazy_words = _lazy(regex, table, n_words, tokens)
    except NotExact as refused:
        reason = "after a complete match" if "complete match" in str(refused) else \
            "no token in a state" if "no token" in str(refused) else \
            "byte-level DFA too large" if "byte-level DFA" in str(refused) else "other"
        result.refused[reason] = result.refused.get(reason, 0) + 1
        row["lazy"] = f"refused: {reason}"
        return
    tokens = _allowed_prefix(lazy, tokens)
    stock_first, stock_whole, index, stock_words = _stock(regex, vocabulary, n_words, tokens)
    stock_ms, lazy_ms = (conversion + stock_first) * 1e3, (conversion + lazy_first) * 1e3
    result.stock_ttfm_ms.append(stock_ms)
    result.lazy_ttfm_ms.append(lazy_ms)
    row.update(stock_ttfm_ms=stock_ms, lazy_ttfm_ms=lazy_ms)
    if tokens:
        result.stock_instance_ms.append((conversion + stock_whole) * 1e3)
        result.lazy_instance_ms.append((conversion + lazy_whole) * 1e3)
        row.update(stock_instance_ms=result.stock_instance_ms[-1], lazy_instance_ms=result.lazy_instance_ms[-1],
                   instance_tokens=len(tokens))
    if not np.array_equal(stock_words, lazy_words):
        result.differences += 1
    before = (result.entries_checked, result.differences)
    row["states"] = _check_states(result, index, lazy)
    row["entries"] = result.entries_checked - before[0]
    row["differences"] = result.differences - before[1]
    if llg is not None:
        t0 = time.perf_counter()
        try:
            matcher = llg.ll.LLMatcher(llg.tok, llg.compile(grammar))
            llg.fill(matcher, llg.bitmask, 0)
        except Exception:  # noqa: BLE001 - a schema llguidance rejects has no TTFM
            return
        result.llguidance_ttfm_ms.append((time.perf_counter() - t0) * 1e3)


def _check_states(result: Result, index: Any, lazy: Any) -> int:
    """Every state the full Index reaches from its start: allowed tokens in full, next states on a spread of them.

    ``get_transitions()`` of a large Index is hundreds of millions of
    Python objects, so states are walked from the start through
    ``get_allowed_tokens`` / ``get_next_state``; the next states of up to
    :data:`NEXT_STATES_PER_STATE` tokens of each state (evenly spread, and
    every distinct next state is reached that way or by the walk) are
    compared.  The proof tests compare every entry on smaller Indexes.
    """
    seen = {index.get_initial_state()}
    todo = list(seen)
    while todo:
        state = todo.pop()
        expected = np.sort(np.asarray(index.get_allowed_tokens(state) or [], dtype=np.int64))
        got = lazy.row(state)
        result.states_checked += 1
        result.entries_checked += len(expected)
        if got is None or not np.array_equal(got.token_ids, expected) or \
                index.is_final_state(state) != lazy.is_final_state(state):
            result.differences += 1
            continue
        step = max(1, len(expected) // NEXT_STATES_PER_STATE)
        lazy_next = dict(zip(got.token_ids.tolist(), got.next_states.tolist()))
        for token in set(expected[::step].tolist()) | {int(t) for t in got.token_ids[np.unique(got.next_states,
                                                                                                 return_index=True)[1]]}:
            if token == lazy.eos_token_id:
                continue
            nxt = index.get_next_state(state, token)
            result.next_states_checked += 1
            if nxt != lazy_next[token]:
                result.differences += 1
                break
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return len(seen)


def _rescue(result: Result, row: dict[str, Any], grammar: Grammar, table: Any, hf: Any, timeout: float,
            n_words: int) -> None:
    """A schema stock timed out or ran out of memory on: the lazy Index, in a fork under the same time limit."""
    result.rescue_tried += 1
    instances = [(valid, json.dumps(value), hf.encode(json.dumps(value), add_special_tokens=False))
                 for valid, value in grammar.tests]
    context = multiprocessing.get_context("fork")
    with context.Pool(1) as pool:
        pending = pool.apply_async(_rescue_in_fork, (grammar.spec, table, instances, n_words))
        try:
            verdict, first, agree = pending.get(timeout)
        except multiprocessing.TimeoutError:
            verdict, first, agree = "timeout", 0.0, 0
        except Exception as err:  # noqa: BLE001 - whatever failed in the fork is counted by name
            verdict, first, agree = type(err).__name__, 0.0, 0
        finally:
            pool.terminate()
    row["lazy"] = verdict
    row["instances"], row["agree_with_label"] = len(instances), agree
    if verdict == "rescued":
        result.rescued += 1
        row["lazy_ttfm_ms"] = first * 1e3
    else:
        result.rescue_failures[verdict] = result.rescue_failures.get(verdict, 0) + 1


def _rescue_in_fork(schema: str, table: Any, instances: list[tuple[bool, str, list[int]]],
                    n_words: int) -> tuple[str, float, int]:
    from outlines_maskcache import outlines_core_calls as core

    t0 = time.perf_counter()
    regex = core.schema_regex(schema)
    conversion = time.perf_counter() - t0
    verdict, first, agree = _judge_lazily(regex, table, instances, n_words)
    return verdict, first + conversion, agree


def as_json(result: Result) -> dict[str, Any]:
    from outlines_maskcache.bench.maskbench import percentiles

    points = (50, 90)
    ratios_first = [lz / st for lz, st in zip(result.lazy_ttfm_ms, result.stock_ttfm_ms)]
    ratios_whole = [lz / st for lz, st in zip(result.lazy_instance_ms, result.stock_instance_ms)]
    out = {k: v for k, v in result.__dict__.items() if k != "per_schema" and not isinstance(v, list)}
    out.update(
        stock_ttfm_ms=percentiles(result.stock_ttfm_ms, points),
        lazy_ttfm_ms=percentiles(result.lazy_ttfm_ms, points),
        llguidance_ttfm_ms=percentiles(result.llguidance_ttfm_ms, points),
        lazy_over_stock_first_mask=percentiles(ratios_first, points),
        lazy_over_stock_whole_instance=percentiles(ratios_whole, points),
        compared=len(result.lazy_ttfm_ms),
        per_schema=result.per_schema,
    )
    return out


def print_result(result: Result) -> None:
    data = as_json(result)
    print(f"tokenizer {result.tokenizer}, {result.schemas} schemas; token table built once in "
          f"{result.table_seconds * 1e3:.0f} ms")
    print(f"stock compile outcomes: {result.stock_status}; lazy refused: {result.refused or 'none'}")
    for name in ("stock_ttfm_ms", "lazy_ttfm_ms", "llguidance_ttfm_ms"):
        p = data[name]
        if p:
            print(f"  {name:22s} p50 {p['p50']:9.1f}  p90 {p['p90']:9.1f}  max {p['max']:9.1f}")
    for name in ("lazy_over_stock_first_mask", "lazy_over_stock_whole_instance"):
        p = data[name]
        if p:
            print(f"  {name:32s} p50 {p['p50']:.3f}  p90 {p['p90']:.3f}")
    print(f"equality: {result.states_checked} states, {result.entries_checked} allowed tokens, "
          f"{result.next_states_checked} next states, {result.differences} differences")
    print(f"stock time-outs/OOM tried lazily: {result.rescue_tried}, rescued {result.rescued}, "
          f"not: {result.rescue_failures or 'none'}")
