"""Several processors sharing one cache, interleaved with resets, clear(), tiny budgets and disabled().

Invariant: every step's cached output equals stock's bit for bit, the budget
holds on every device, and the counters add up.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, rule

import outlines_maskcache as mc
from support.drivers import Lockstep, assert_bit_identical, random_logits
from support.versions import requires_outlines_core_backend

pytestmark = requires_outlines_core_backend

VOCAB = {"a": [0], "b": [1], "ab": [2], "ba": [3], "0": [4], "1": [5], "01": [6, 7], '"': [8], "a0": [9]}
EOS = 10
WIDTH = 14
PATTERNS = [r"(ab|ba)+0?", r'"[ab01]{0,5}"', r"a*b*[01]{1,3}", r"(a|b)(0|1)(a|ab)*"]


class SharedCache(RuleBasedStateMachine):
    pairs = Bundle("pairs")

    @initialize()
    def setup(self):
        from outlines_core import Index, Vocabulary

        mc.clear()
        mc.reset_stats()
        mc.configure(max_bytes=1 << 30)
        self.indexes = [Index(p, Vocabulary(EOS, VOCAB)) for p in PATTERNS]
        self.rng = np.random.default_rng(0)
        self.state: dict[int, dict] = {}
        self.budget = 1 << 30

    @rule(target=pairs, which=st.integers(0, len(PATTERNS) - 1), batch=st.integers(1, 5))
    def new_processor(self, which, batch):
        pair = Lockstep(self.indexes[which])
        self.state[id(pair)] = {"ids": self.rng.integers(0, WIDTH, (batch, 1)), "done": [False] * batch}
        return pair

    @rule(pair=pairs, batch=st.integers(1, 5))
    def reset(self, pair, batch):
        pair.reset()
        self.state[id(pair)] = {"ids": self.rng.integers(0, WIDTH, (batch, 1)), "done": [False] * batch}

    @rule(pair=pairs, dtype=st.sampled_from([torch.float32, torch.bfloat16]), stock_only=st.booleans())
    def step(self, pair, dtype, stock_only):
        st_ = self.state[id(pair)]
        ids, done = st_["ids"], st_["done"]
        logits = random_logits(self.rng, ids.shape[0], WIDTH, dtype, "torch", specials=True)
        if stock_only:
            with mc.disabled():
                stock, cached, err = pair.step(torch.from_numpy(ids), logits)
        else:
            stock, cached, err = pair.step(torch.from_numpy(ids), logits)
        if err is not None:
            return
        assert_bit_identical(stock, cached)
        nxt = []
        for r in range(ids.shape[0]):
            allowed = np.flatnonzero(np.asarray(stock[r].float()) != -np.inf)
            token = EOS if done[r] or allowed.size == 0 else int(self.rng.choice(allowed))
            done[r] = done[r] or token == EOS
            nxt.append(token)
        st_["ids"] = np.concatenate([ids, np.asarray(nxt)[:, None]], axis=1)

    @rule()
    def clear(self):
        mc.clear()

    @rule(budget=st.sampled_from([0, 30, 64, 200, 1 << 30]))
    def set_budget(self, budget):
        self.budget = budget
        mc.configure(max_bytes=budget)

    @rule(fraction=st.sampled_from([0.0, 0.2, 1.0]))
    def set_sparse(self, fraction):
        # Rows already cached keep their kind: dense and sparse rows then meet in one batch.
        mc.configure(sparse_below=fraction)

    @invariant()
    def bounded_and_counted(self):
        if not hasattr(self, "budget"):
            return
        stats = mc.stats()
        assert all(used <= self.budget for used in stats["bytes_by_device"].values())
        assert stats["fallbacks"] == 0 and stats["invalid"] == 0
        assert stats["entries"] <= stats["misses"]


SharedCache.TestCase.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)
TestSharedCache = SharedCache.TestCase
