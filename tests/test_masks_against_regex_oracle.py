"""An independent oracle: interegular's FSM decides which tokens each prefix allows.

outlines compares with itself elsewhere; here the allowed set of every
served mask is recomputed from the regex alone: token t is allowed after
prefix p iff p+t can still be extended to a match (every single character is
a token, so string-liveness equals token-liveness), and EOS iff p matches.
"""

from __future__ import annotations

import interegular
import numpy as np
import torch
from hypothesis import assume, example, given
from hypothesis import strategies as st

from packaging.version import Version

import outlines_maskcache as mc
from support.strategies import regexes, vocabularies
from support.versions import outlines_version, requires_outlines_core_backend

pytestmark = requires_outlines_core_backend


class Oracle:
    def __init__(self, regex: str) -> None:
        fsm = interegular.parse_pattern(regex).to_fsm()
        self.fsm = fsm
        reverse: dict = {}
        for state, edges in fsm.map.items():
            for _, nxt in edges.items():
                reverse.setdefault(nxt, set()).add(state)
        live, frontier = set(fsm.finals), list(fsm.finals)
        while frontier:
            for prev in reverse.get(frontier.pop(), ()):
                if prev not in live:
                    live.add(prev)
                    frontier.append(prev)
        self.live = live

    def path(self, text: str) -> list:
        """The state after each prefix of ``text``, the empty one first; ends in None where it dies."""
        states = [self.fsm.initial]
        for ch in text:
            states.append(self.fsm.map.get(states[-1], {}).get(self.fsm.alphabet[ch]))
            if states[-1] is None:
                break
        return states

    def run(self, text: str):
        return self.path(text)[-1]

    def allows(self, prefix: str, token: str) -> bool:
        state = self.run(prefix + token)
        return state is not None and state in self.live

    def complete(self, prefix: str) -> bool:
        return self.run(prefix) in self.fsm.finals

    def matched_before_end(self, text: str) -> bool:
        """Whether some proper prefix of ``text`` (the empty one included) is a match.

        outlines_core compiles with regex-automata's leftmost-first semantics:
        once a higher-priority branch matches, the lower-priority threads are
        cut, so ``a|aa`` never reads the second ``a``.  Threads are cut only
        at a match, so a string with no match before its end reaches the full
        subset state, and there outlines_core must allow exactly what the
        regex does.
        """
        return any(state in self.fsm.finals for state in self.path(text)[:len(text)])


#: outlines 1.2.4 also advances a finished guide that accepts the token (outlines_core#227)
ADVANCES_FINISHED_GUIDES = outlines_version() >= Version("1.2.4")

#: complete prefixes where outlines_core (stock and cached alike) disallows EOS
UPSTREAM_GAPS: list[tuple[str, str]] = []


@given(regex=regexes(max_depth=2), vocab=vocabularies(max_extra=15), seed=st.integers(0, 2**32 - 1))
# Found by CI: leftmost-first drops "aa" from the start state of (a|aa).
@example(regex="(a|aa)", vocab=({"a": [0], "b": [1], "aa": [2]}, 3, 4), seed=0)
# Found by CI on outlines 1.2.0/1.2.3: a finished guide stays put there, so "a" after "aa" is stock's.
@example(regex="(aa|a)", vocab=({"a": [0], "b": [1]}, 2, 3), seed=0)
@example(regex="(a|(b)*)", vocab=({"a": [0], "b": [1]}, 2, 3), seed=0)
def test_cached_masks_match_the_interegular_oracle(regex, vocab, seed):
    from outlines_core import Index, Vocabulary
    from outlines.backends.outlines_core import OutlinesCoreLogitsProcessor

    tokens, eos, n_ids = vocab
    try:
        oracle = Oracle(regex)
        index = Index(regex, Vocabulary(eos, tokens))
    except Exception:  # noqa: BLE001 - a regex one side cannot read says nothing
        assume(False)
    id_to_text = {i: t for t, ids in tokens.items() for i in ids}
    rng = np.random.default_rng(seed)
    processor = OutlinesCoreLogitsProcessor(index, "torch")
    stock = OutlinesCoreLogitsProcessor(index, "torch")
    ids, prefix = [n_ids - 1], ""
    for _ in range(10):
        out = processor(torch.tensor([ids]), torch.zeros(1, n_ids))
        with mc.disabled():
            stock_out = stock(torch.tensor([ids]), torch.zeros(1, n_ids))
        allowed = set(np.flatnonzero(out[0].numpy() != -np.inf).tolist())
        assert allowed == set(np.flatnonzero(stock_out[0].numpy() != -np.inf).tolist()), (regex, prefix)
        expected = {i for i, text in id_to_text.items() if oracle.allows(prefix, text)}
        complete = oracle.complete(prefix)
        if complete:
            expected.add(eos)
        # Sound everywhere: nothing the regex forbids, EOS only on a match.
        assert allowed <= expected, (regex, prefix, allowed - expected)
        # Complete wherever leftmost-first cannot have cut a thread (see
        # Oracle.matched_before_end): every token the regex allows there is served.
        uncut = {i for i in expected - {eos} if not oracle.matched_before_end(prefix + id_to_text[i])}
        assert uncut <= allowed, (regex, prefix, uncut - allowed)
        if not complete:
            assert eos not in allowed, (regex, prefix)
        elif eos not in allowed:
            # outlines_core 0.2.x can also lose EOS on a complete prefix after
            # multi-byte characters (e.g. '(([abé]){2,3})*' after 'éébé');
            # stock does the same (asserted above): reproduced, not fixed.
            UPSTREAM_GAPS.append((regex, prefix))
        # Past a match outlines_core may omit tokens the regex allows (a|aa
        # drops "aa"; (aa)* after "aa" drops "a", test_upstream_final_state_gap):
        # the cache reproduces stock there, it does not "fix" it.
        choices = sorted(allowed - {eos})
        if not choices or (stock._guides[0].is_finished() and not ADVANCES_FINISHED_GUIDES):
            # Before outlines 1.2.4 a finished guide consumes no more tokens, so
            # the prefix below would no longer be the guide's: the processor's
            # steps there are checked against stock in test_backend_matches_its_release.
            break
        token = int(rng.choice(choices))
        ids.append(token)
        prefix += id_to_text[token]
    assert mc.stats()["misses"] > 0


def test_upstream_final_state_gap_is_reproduced_not_fixed():
    """outlines_core 0.2.14 allows only EOS after "aa" for (aa)* although "aaaa" matches.

    Found by the oracle above; documented in docs/design.md.  Stock and cached agree.
    """
    from outlines_core import Index, Vocabulary
    from support.drivers import Lockstep

    index = Index("(aa)*", Vocabulary(9, {"a": [0]}))
    pair = Lockstep(index)
    ids = torch.tensor([[1]])
    for token in (0, 0):
        stock, cached, err = pair.step(ids, torch.zeros(1, 10))
        assert err is None and torch.equal(stock, cached)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    stock, cached, _ = pair.step(ids, torch.zeros(1, 10))
    assert torch.equal(stock, cached)
    assert stock[0, 0] == -torch.inf and stock[0, 9] == 0  # only EOS
    assert Oracle("(aa)*").allows("aa", "a")
