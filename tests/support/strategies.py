"""Hypothesis strategies: random regexes and random vocabularies.

Regexes are drawn from a small grammar (literals, classes, alternation,
repetition, optional, multi-byte characters) that both outlines_core and
interegular read the same way, so the oracle test can use them too.
"""

from __future__ import annotations

import re

from hypothesis import strategies as st

ALPHABET = ["a", "b", "c", "0", "1", " ", "é", "{", '"']


def _literal(ch: str) -> str:
    return re.escape(ch) if ch not in ("é", " ") else ch


@st.composite
def regexes(draw, alphabet=ALPHABET, max_depth: int = 3) -> str:
    def node(depth: int) -> str:
        kinds = ["lit", "class"] + (["cat", "alt", "star", "plus", "opt", "rep"] if depth < max_depth else [])
        kind = draw(st.sampled_from(kinds))
        if kind == "lit":
            return "".join(_literal(c) for c in draw(st.lists(st.sampled_from(alphabet), min_size=1, max_size=3)))
        if kind == "class":
            chars = draw(st.sets(st.sampled_from([c for c in alphabet if c not in "{\""]), min_size=1, max_size=4))
            return "[" + "".join(sorted(re.escape(c) if c not in ("é", " ") else c for c in chars)) + "]"
        if kind == "cat":
            return "".join(node(depth + 1) for _ in range(draw(st.integers(2, 3))))
        if kind == "alt":
            return "(" + "|".join(node(depth + 1) for _ in range(draw(st.integers(2, 3)))) + ")"
        inner = "(" + node(depth + 1) + ")"
        if kind == "star":
            return inner + "*"
        if kind == "plus":
            return inner + "+"
        if kind == "opt":
            return inner + "?"
        lo = draw(st.integers(0, 2))
        return inner + "{%d,%d}" % (lo, lo + draw(st.integers(0, 2)))

    return node(0)


@st.composite
def vocabularies(draw, alphabet=ALPHABET, max_extra: int = 40):
    """A token->ids dict with every single character (so every regex string is
    reachable), overlapping multi-char tokens, and some strings mapped to
    several ids (duplicates, as real tokenizers have).  Returns (vocab, eos_id, n_ids).
    """
    tokens = list(dict.fromkeys(alphabet))
    extra = draw(st.lists(st.text(alphabet="".join(alphabet), min_size=2, max_size=4), max_size=max_extra))
    tokens += [t for t in dict.fromkeys(extra) if t not in tokens]
    ids = list(range(len(tokens) + 8))
    order = draw(st.permutations(ids))
    vocab: dict[str, list[int]] = {}
    cursor = 0
    for tok in tokens:
        vocab[tok] = [order[cursor]]
        cursor += 1
    eos = order[cursor]
    cursor += 1
    for extra_id in order[cursor:]:
        if draw(st.booleans()):
            vocab[draw(st.sampled_from(tokens))].append(extra_id)
    return vocab, eos, len(ids)
