"""How outlines_core's ``Index`` decides a token, pinned where a lazy, per-state Index must follow it (#29).

``Index::new`` walks each token's bytes through regex_automata's DFA,
stopping only at dead or quit states, and then checks the state the token
ends in once: it is kept if that state is not a match state, or if the
input would be a complete match there (``is_match_state(next_eoi_state)``).
regex_automata reports a match one byte late, so a byte that follows a
complete match of the whole regex lands in a *match* state, and the check
drops a token that *ends* there.  A token that only passes through it is
kept.

A byte-level Index (one-byte tokens) therefore drops every transition into
such a state, and with it every longer token that crosses it: the reason a
byte-level Index built from a JSON schema with ``"format": "uri"`` misses
tokens such as ``"},"`` (the URI's ``[^\\s]*`` can absorb the closing
``"}`` and go on past a complete match).  A lazy Index that walks tokens
through a byte-level Index would serve wrong masks there; it must walk the
raw DFA and apply the end check once per token.
"""

from __future__ import annotations

import pytest

outlines_core = pytest.importorskip("outlines_core")
if not hasattr(outlines_core, "Index"):
    pytest.skip("outlines_core before 0.2 has no Python Index", allow_module_level=True)


def _walk(index, ids):
    state = index.get_initial_state()
    for token in ids:
        state = index.get_next_state(state, token)
        assert state is not None
    return state


def test_a_token_may_cross_the_state_after_a_complete_match_but_not_end_there():
    from outlines_core import Index, Vocabulary

    regex = r'"[^ ]*"'  # '"x"' is a complete match, and '[^ ]*' can also absorb the '"' and go on
    full = Index(regex, Vocabulary(9, {'"': [0], "x": [1], "y": [2], '"y': [4], '"yy': [3]}))
    after_x = _walk(full, [0, 1])
    allowed = set(full.get_allowed_tokens(after_x))
    assert 3 in allowed, "'\"yy' crosses the match state ('\"x\"' then 'y') and ends inside the string"
    assert 4 not in allowed, "'\"y' ends in the match state that reports '\"x\"', and is dropped"


def test_a_byte_level_index_drops_the_byte_into_that_state():
    from outlines_core import Index, Vocabulary

    regex = r'"[^ ]*"'
    byte = Index(regex, Vocabulary(9, {'"': [0], "x": [1], "y": [2]}))
    closed = _walk(byte, [0, 1, 0])  # '"x"': a complete match
    assert set(byte.get_allowed_tokens(closed)) == {0, 9}, "'y' after a complete match is not a byte transition"
