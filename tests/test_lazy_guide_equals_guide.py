"""``LazyGuide`` behaves as outlines_core's ``Guide``: the same states, answers, rollback window and errors.

vLLM builds its guides with ``max_rollback`` = the number of speculative
tokens, 0 without speculative decoding; stock's Rust ``Guide`` keeps past
states in a ``VecDeque`` of that capacity, which grows from 0 to 4 on the
first advance, so stock can roll back up to 4 steps with
``max_rollback=0``.  A lazy Index handed to vLLM must give its guides the
same window, or a rollback that stock allows raises (CI caught exactly
that: a vLLM test rolled back one step while the full Index was still
being compiled).  Here both guides run the same random operations,
rejected ones included, and every answer and message is compared.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

outlines_core = pytest.importorskip("outlines_core")
if not hasattr(getattr(outlines_core, "Guide", None), "get_allowed_rollback"):
    pytest.skip("outlines_core before 0.2.10 has no rollback in its Guide", allow_module_level=True)

from outlines_core import Guide, Index, Vocabulary  # noqa: E402

from outlines_maskcache import outlines_core_calls as core  # noqa: E402
from outlines_maskcache.lazy_index import LazyGuide, LazyIndex  # noqa: E402
from support.strategies import regexes, vocabularies  # noqa: E402

#: vLLM's value without speculative decoding, small windows, stock's default
ROLLBACKS = [0, 1, 2, 3, 5, 32]


def outcome(call):
    """What a call gave: its value, or its exception's type and message."""
    try:
        return ("ok", call())
    except Exception as err:  # noqa: BLE001 - the error is part of what must match
        return (type(err).__name__, str(err))


def mask_of(guide, words: int) -> list[int]:
    out = np.zeros(words, dtype=np.uint32)
    guide.write_mask_into(out.ctypes.data, words, 4)
    return out.tolist()


def run_both(lazy_index: LazyIndex, full, max_rollback: int | None, choices: list[tuple[int, int]]) -> None:
    args = () if max_rollback is None else (max_rollback,)
    lazy, stock = LazyGuide(lazy_index, *args), Guide(full, *args)
    words = (lazy_index.vocab_size + 31) // 32
    for step, (op, pick) in enumerate(choices):
        where = f"step {step}, op {op}, max_rollback={max_rollback}"
        assert lazy.get_state() == stock.get_state(), where
        assert lazy.get_allowed_rollback() == stock.get_allowed_rollback(), where
        assert lazy.is_finished() == stock.is_finished(), where
        allowed = sorted(stock.get_tokens())
        assert sorted(lazy.get_tokens()) == allowed, where
        if op <= 4 and allowed:  # advance on an allowed token (most steps), sometimes asking for the list
            token = allowed[pick % len(allowed)]
            flag = (None, False, True)[pick % 3]
            got, want = outcome(lambda: lazy.advance(token, flag)), outcome(lambda: stock.advance(token, flag))
            if want[0] == "ok" and want[1] is not None:
                got, want = (got[0], sorted(got[1])), (want[0], sorted(want[1]))
            assert got == want, where
        elif op == 5:  # a token outside the state's row: both raise the same error and stay put
            token = pick % (lazy_index.vocab_size + 2)
            if token not in allowed:
                assert outcome(lambda: lazy.advance(token)) == outcome(lambda: stock.advance(token)), where
        elif op == 6:  # roll back, sometimes further than the window allows
            n = pick % 7
            assert outcome(lambda: lazy.rollback_state(n)) == outcome(lambda: stock.rollback_state(n)), where
        elif op == 7:
            sequence = [allowed[pick % len(allowed)]] if allowed else []
            sequence.append(pick % (lazy_index.vocab_size + 1))
            assert lazy.accepts_tokens(sequence) == stock.accepts_tokens(sequence), where
        elif op == 8:
            lazy.reset()
            stock.reset()
        else:
            assert mask_of(lazy, words) == mask_of(stock, words), where


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(regex=regexes(), vocab=vocabularies(), max_rollback=st.sampled_from([None, *ROLLBACKS]),
       choices=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 10_000)), min_size=5, max_size=60))
def test_random_walks_with_rollbacks_match_stock(regex, vocab, max_rollback, choices):
    tokens, eos, _ = vocab
    vocabulary = Vocabulary(eos, tokens)
    try:
        lazy_index = core.lazy_index(regex, vocabulary)
    except Exception:  # noqa: BLE001 - refused (NotExact) or uncompilable: no LazyGuide is ever made
        return
    run_both(lazy_index, Index(regex, vocabulary), max_rollback, choices)


@pytest.mark.parametrize("max_rollback", ROLLBACKS)
def test_the_rollback_window_is_stocks_at_every_depth(max_rollback):
    """A long walk on a cyclic regex, then rolling back one step at a time until both refuse."""
    vocabulary = Vocabulary(9, {"a": [0], "b": [1], "ab": [2], "c": [3]})
    regex = "(ab|c)+"
    lazy_index, full = core.lazy_index(regex, vocabulary), Index(regex, vocabulary)
    lazy, stock = LazyGuide(lazy_index, max_rollback), Guide(full, max_rollback)
    # before any advance the window is empty (and reported as max_rollback)
    assert outcome(lambda: lazy.rollback_state(1)) == outcome(lambda: stock.rollback_state(1))
    for step in range(13):
        allowed = sorted(set(stock.get_tokens()) - {9})  # EOS has no next state in either
        token = allowed[step % len(allowed)]
        lazy.advance(token, False)
        stock.advance(token, False)
        assert lazy.get_allowed_rollback() == stock.get_allowed_rollback()
    while True:
        got, want = outcome(lambda: lazy.rollback_state(1)), outcome(lambda: stock.rollback_state(1))
        assert got == want
        assert lazy.get_state() == stock.get_state()
        if want[0] != "ok":
            break


def test_a_negative_window_is_refused_as_stock():
    vocabulary = Vocabulary(9, {"a": [0], "b": [1]})
    lazy_index, full = core.lazy_index("a+b", vocabulary), Index("a+b", vocabulary)
    assert outcome(lambda: LazyGuide(lazy_index, -1)) == outcome(lambda: Guide(full, -1))
