"""The benchmarks' own logic: loops, walks, statistics and summaries (no timing is asserted here).

A benchmark that silently measured the wrong thing would mislead every
claim built on it, so the parts that decide *what* is measured are tested:
the realistic loop really sweeps, random walks are reproducible (stock and
cached must walk the same paths), the floor with per-row operands has the
logits' shape, the confidence interval brackets its median, and the
JSONSchemaBench summary pairs each schema with its own baseline.
"""

from __future__ import annotations

import pytest
import torch

from outlines_maskcache.bench import micro
from outlines_maskcache.bench.paired import bootstrap_median


def test_loops_give_fresh_logits_and_only_the_realistic_one_sweeps():
    hot = micro.Loop("hot", 2, 16, torch.device("cpu"))
    real = micro.Loop("realistic", 2, 16, torch.device("cpu"))
    assert hot.sweep is None and real.sweep is not None and real.sweep.nbytes >= 2 * (32 << 20) - 1
    a, b = real.logits(0), real.logits(0)
    assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()  # a fresh copy every step
    assert float(real.sweep[0]) == 2.0  # swept once per step
    with pytest.raises(ValueError):
        micro.Loop("warm", 2, 16, torch.device("cpu"))


def test_random_walk_is_reproducible_and_respects_the_mask():
    masked = torch.full((4, 50), -float("inf"))
    masked[:, 10:20] = torch.randn(4, 10)
    draws = [micro.next_tokens(masked, "random", torch.Generator().manual_seed(3)) for _ in range(2)]
    assert torch.equal(draws[0], draws[1])
    assert bool(((draws[0] >= 10) & (draws[0] < 20)).all())
    assert torch.equal(micro.next_tokens(masked, "greedy", torch.Generator()), masked.argmax(-1, keepdim=True))


def test_floors_time_the_same_op_on_fresh_logits():
    loop = micro.Loop("hot", 3, 32, torch.device("cpu"))
    assert len(list(micro.floor_steps(loop, 4))) == 4
    assert len(list(micro.floor_steps(loop, 4, per_row=True))) == 4


def test_bootstrap_interval_brackets_the_median():
    values = [0.9, 0.95, 0.97, 0.98, 1.0, 1.01, 1.02]
    median, low, high = bootstrap_median(values)
    assert median == pytest.approx(0.98)
    assert low <= median <= high and min(values) <= low and high <= max(values)
    assert bootstrap_median([1.0] * 5) == (1.0, 1.0, 1.0)


def test_jsonschemabench_summary_pairs_each_schema_with_its_baseline():
    from outlines_maskcache.bench import jsonschemabench as jsb

    def timing(ttft: float, tpot: float) -> dict:
        return {"ttft": ttft, "tpot": tpot, "tokens": 10}

    per_schema = [{"constrained": timing(1.0, 0.012), "unconstrained": timing(0.05, 0.010),
                   "noop": timing(0.05, 0.0105)},
                  {"constrained": timing(0.2, 0.022), "unconstrained": timing(0.05, 0.020),
                   "noop": timing(0.05, 0.021)},
                  {"constrained": timing(0.4, 0.033), "unconstrained": timing(0.05, 0.030),
                   "noop": timing(0.05, 0.0315)}]
    rows = jsb.summarize({"llamacpp": {"warm": per_schema}, "transformers": {"skipped": "no model"}})
    base, noop, warm, skipped = rows
    assert base["setup"] == "unconstrained" and base["n"] == 3
    assert noop["setup"] == "noop" and noop["tpot_over_unconstrained"] == pytest.approx(1.05)
    assert warm["first_ttft_ms"] == pytest.approx(1000.0)
    assert warm["n"] == 2 and warm["ttft_ms_p50"] == pytest.approx(300.0)  # the first schema is apart
    assert warm["tpot_over_unconstrained"] == pytest.approx(1.1)  # median of 1.2, 1.1, 1.1
    low, high = warm["tpot_ratio_ci"]
    assert 1.1 <= high <= 1.2 and low == pytest.approx(1.1)
    assert warm["tpot_ratio_pooled"] == pytest.approx((0.012 + 0.022 + 0.033) / (0.010 + 0.020 + 0.030))
    assert skipped == {"engine": "transformers", "skipped": "no model"}
