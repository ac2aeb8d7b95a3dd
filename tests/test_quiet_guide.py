"""The quiet guide: ``advance`` skips building the token list only where its caller discards it."""

from __future__ import annotations

import pytest

from outlines_maskcache.targets.vllm.quiet_guide import QuietGuide


class Spy:
    """Stands in for outlines_core's Guide: records how advance was called."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def advance(self, token, *args):
        self.calls.append(args)
        return None if args == (False,) else [token, token + 1]

    def get_state(self):
        return len(self.calls)


def _last(spy: Spy) -> tuple:
    return spy.calls[-1]


def statement(g, t):
    g.advance(t)


def loop(g, tokens):
    for t in tokens:
        g.advance(t)


def assigned(g, t):
    x = g.advance(t)
    return x


def returned(g, t):
    return g.advance(t)


def passed_on(g, t):
    return len(g.advance(t))


def in_comprehension(g, tokens):
    return [g.advance(t) for t in tokens]


def conditional(g, t):
    if g.advance(t):
        return True
    return False


def explicit(g, t):
    g.advance(t, True)


def test_discarded_results_build_no_list():
    spy = Spy()
    g = QuietGuide(spy)
    statement(g, 1)
    assert _last(spy) == (False,)
    loop(g, [1, 2, 3])
    assert spy.calls[-3:] == [(False,)] * 3


@pytest.mark.parametrize("caller", [assigned, returned, passed_on, conditional])
def test_used_results_get_the_list(caller):
    spy = Spy()
    result = caller(QuietGuide(spy), 5)
    assert _last(spy) == ()  # stock's own call: return_tokens left at its default
    assert result in ([5, 6], True, 2)


def test_comprehension_and_explicit_arguments_are_stock():
    spy = Spy()
    g = QuietGuide(spy)
    assert in_comprehension(g, [1, 2]) == [[1, 2], [2, 3]]
    assert spy.calls == [(), ()]
    explicit(g, 1)
    assert _last(spy) == (True,)
    assert g.advance(3, False) is None and _last(spy) == (False,)
    eval("g.advance(4)", {"g": g})  # an exec'd expression's value is its result: stock
    assert _last(spy) == ()


def test_other_attributes_delegate():
    spy = Spy()
    g = QuietGuide(spy)
    assert g.get_state() == 0
    with pytest.raises(AttributeError):
        g.no_such_method  # noqa: B018


def test_real_guide_states_equal_stock():
    oc = pytest.importorskip("outlines_core")
    if not hasattr(oc, "Guide"):
        pytest.skip("outlines_core < 0.2 has no Rust Guide (vLLM uses >= 0.2)")
    vocab = oc.Vocabulary(9, {"a": [1], "b": [2], "ab": [3], "x": [4]})
    index = oc.Index(r"(ab|a)b*x", vocab)
    quiet, stock = QuietGuide(oc.Guide(index)), oc.Guide(index)
    for token in (3, 2, 2, 4):
        assert sorted(quiet.get_tokens()) == sorted(stock.get_tokens())
        quiet.advance(token)  # discarded: the quick path
        stock.advance(token)
        assert quiet.get_state() == stock.get_state()
    assert quiet.is_finished() and stock.is_finished()
    quiet.rollback_state(2)
    stock.rollback_state(2)
    assert quiet.get_state() == stock.get_state()
    used = quiet.advance(2)
    assert sorted(used) == sorted(stock.advance(2))
