"""Could vLLM's dense bitmask rows be applied faster than xgrammar's CPU kernel? (a probe, not a bench mode)

    python benchmarks/vllm_dense_apply_probe.py [--batch 32] [--vocab 128256] [--blocked 0.04] [--repeats 30]

Rows inside a JSON string allow almost every token, so a cached list of the
few blocked ids per state looks like a cheaper apply than xgrammar's
bit-by-bit kernel.  Timed on fresh (B, V) logits from a matmul (as a forward
pass leaves them), two distinct dense states spread over the batch:

* ``xgrammar``: ``apply_token_bitmask_inplace`` (what vLLM calls);
* ``index_put``: each state's blocked ids written with one ``index_put_``;
* ``flat_index_fill``: all rows' blocked ids as one flat ``index_fill_``;
* ``match_only``: only finding which cached row each bitmask row equals,
  which any such apply must pay first, as one vectorised compare;
* ``match_bytes``, ``match_array_equal``, ``match_memoryview``: the same
  match row by row, as ``bytes`` (a memcmp, what ``bitmask_plans`` ships),
  with ``np.array_equal``, and with ``memoryview`` equality.

Every variant's result is checked equal to xgrammar's before timing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--blocked", type=float, default=0.04, help="share of the vocabulary each state blocks")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    import xgrammar as xgr

    batch, vocab = args.batch, args.vocab
    words = (vocab + 31) // 32
    rng = np.random.default_rng(0)
    states, blocked = [], []
    for _ in range(2):
        allowed = np.zeros(words * 32, dtype=bool)
        allowed[:vocab] = rng.random(vocab) > args.blocked
        states.append(np.packbits(allowed, bitorder="little").view(np.int32))
        blocked.append(torch.from_numpy(np.flatnonzero(~allowed[:vocab])))
    bitmask = torch.from_numpy(np.stack([states[r % 2] for r in range(batch)]))
    stacked = np.stack(states)
    weights, hidden = torch.randn(256, vocab), torch.randn(batch, 256)

    def match() -> np.ndarray:
        bits = bitmask.numpy()
        found = np.full(batch, -1)
        for k in range(len(states)):
            found[((bits == stacked[k]).all(axis=1)) & (found < 0)] = k
        return found

    def match_rows(same) -> list[int]:
        """match() row by row: ``same(row, k)`` says whether a bitmask row equals state k."""
        bits = bitmask.numpy()
        return [next((k for k in range(len(states)) if same(bits[r], k)), -1) for r in range(batch)]

    known_bytes = [state.tobytes() for state in states]
    known_views = [memoryview(state).cast("B") for state in states]
    matchers = {
        "match_bytes": lambda row, k: row.tobytes() == known_bytes[k],
        "match_array_equal": lambda row, k: np.array_equal(row, states[k]),
        "match_memoryview": lambda row, k: memoryview(row).cast("B") == known_views[k],
    }

    def index_put(logits: torch.Tensor) -> None:
        found = match()
        for k, ids in enumerate(blocked):
            rows = torch.from_numpy(np.flatnonzero(found == k))
            if len(rows):
                logits.index_put_((rows[:, None], ids[None, :]), torch.tensor(float("-inf")))

    def flat_index_fill(logits: torch.Tensor) -> None:
        found = match()
        flat = torch.cat([(torch.from_numpy(np.flatnonzero(found == k))[:, None] * vocab + ids[None, :]).reshape(-1)
                          for k, ids in enumerate(blocked)])
        logits.view(-1).index_fill_(0, flat, float("-inf"))

    variants = {"xgrammar": lambda logits: xgr.apply_token_bitmask_inplace(logits, bitmask),
                "index_put": index_put, "flat_index_fill": flat_index_fill, "match_only": lambda logits: match()}
    variants.update({name: (lambda logits, same=same: match_rows(same)) for name, same in matchers.items()})
    expected = hidden @ weights
    for name, same in matchers.items():
        if match_rows(same) != match().tolist():
            raise AssertionError(f"{name} matches rows differently")
    variants["xgrammar"](expected)
    for name in ("index_put", "flat_index_fill"):
        got = hidden @ weights
        variants[name](got)
        if not torch.equal(got, expected):
            raise AssertionError(f"{name} differs from xgrammar")
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):  # interleaved, fresh logits before every call
        for name, fn in variants.items():
            logits = hidden @ weights
            t0 = time.perf_counter()
            fn(logits)
            seconds[name].append(time.perf_counter() - t0)
    print(f"B={batch} V={vocab:,} blocked {args.blocked:.0%}, torch threads {torch.get_num_threads()}, "
          f"median of {args.repeats}:")
    for name, values in seconds.items():
        print(f"  {name:16s} {statistics.median(values) * 1e6:9.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
