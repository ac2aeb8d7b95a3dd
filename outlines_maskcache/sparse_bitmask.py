"""Applying an int32 token bitmask to CPU logits: sparse rows by a cached plan, the rest by the caller's kernel.

The CPU kernel engines use to apply a packed bitmask (xgrammar's
``apply_token_bitmask_inplace_cpu``, which vLLM calls for every constrained
row of every CPU step) writes ``-inf`` one blocked token at a time: about
4 ns per blocked token, so a row that allows 1,000 of 128k tokens costs
~500 us, against ~40 us for a row inside a JSON string that blocks a few
thousand (measured on this project's machine, B = 32, 128k, fresh logits).
A sparse row is cheaper the other way round: keep the few allowed logits,
fill the whole row with ``-inf`` (a memset) and put them back: ~40-60 us.

The allowed ids of a row depend only on the row's bits, and a grammar
visits few distinct sparse states, so the ids are kept in a bounded LRU
keyed by the row's *content* (its bytes, compared in full by the dict):
whatever filled the bitmask, and however the caller reordered it, a plan is
only ever used for bits equal to the ones it was made from.  Nothing here
knows which engine or grammar produced the bitmask.

Semantics are the kernel's, bit for bit, NaN included: for every listed row
and every token ``j < vocab_size`` whose bit is 0 the logit becomes
``-inf``; allowed logits are copied out and back unchanged; tokens at or past
``vocab_size`` are untouched.  All plans are made, and all allowed values
read, before the first logit is written, so a failure until then leaves the
logits as they were and the caller's kernel can run instead; a failure
after it restores the allowed values or raises ``LogitsLost``.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence

import numpy as np

#: a row is planned when it allows at most 1/SPARSE_SHARE of the vocabulary: past
#: that, copying the allowed logits out and back costs more than the kernel's writes
SPARSE_SHARE = 4
#: words per row read to estimate how many tokens it allows
SAMPLED_WORDS = 64
#: bytes of planned rows (keys and ids) kept before the least recently used is dropped
DEFAULT_MAX_BYTES = 64 << 20

#: applies the kernel to the given rows; None means the whole call, exactly as the caller made it
Fallback = Callable[[Optional[list[int]]], None]


class SparseBitmaskApplier:
    """Applies bitmask rows that allow few tokens with a cached keep-fill-restore plan."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._plans: OrderedDict[tuple[int, bytes], Any] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        #: plans made (misses of the LRU)
        self.plans_made = 0

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._plans)

    def applies_to(self, logits: Any, bitmask: Any) -> bool:
        """Whether :meth:`apply` can take these tensors (else the caller's kernel runs them all)."""
        import torch

        return (isinstance(logits, torch.Tensor) and isinstance(bitmask, torch.Tensor)
                and logits.device.type == "cpu" and bitmask.device.type == "cpu"
                and logits.dim() == 2 and bitmask.dim() == 2 and bitmask.dtype == torch.int32
                and logits.dtype in (torch.float32, torch.float16, torch.bfloat16)
                and bitmask.stride(1) == 1 and sys.byteorder == "little")

    def apply(self, logits: Any, bitmask: Any, rows: Sequence[int] | None, vocab_size: int | None,
              fallback: Fallback) -> tuple[int, int]:
        """Mask ``logits[r]`` by ``bitmask[r]`` for each ``r`` in ``rows`` (all rows when None).

        Sparse rows are planned here; every other row is passed, in one
        call, to ``fallback(rows)``, which must apply the same semantics; a
        call this cannot read as documented (rows out of range, shapes that
        disagree) goes whole to ``fallback(None)``.
        Returns (rows applied by a plan, rows handed to the fallback).
        """
        n_rows = logits.shape[0]
        if rows is None:
            if bitmask.shape[0] != n_rows:
                return _whole(fallback, n_rows)
            wanted = list(range(n_rows))
        else:
            wanted = [int(r) for r in rows]
        n = min(int(logits.shape[1]), int(bitmask.shape[1]) * 32) if vocab_size is None else int(vocab_size)
        words = (n + 31) // 32
        if not wanted or n <= 0 or words > bitmask.shape[1] or n > logits.shape[1]:
            return _whole(fallback, len(wanted))
        bits = bitmask.numpy()
        if any(r < 0 or r >= n_rows or r >= bits.shape[0] for r in wanted):
            return _whole(fallback, len(wanted))  # the kernel decides what an out-of-range index means
        every_row = words == bits.shape[1] and wanted == list(range(bits.shape[0]))
        picked = bits if every_row else bits[wanted, :words]
        sparse = [(r, self._plan(bits[r, :words], n)) for r, count in zip(wanted, _allowed_estimates(picked, n))
                  if count * SPARSE_SHARE <= n]
        rest: list[int] = []
        if len(sparse) != len(wanted):
            planned = {r for r, _ in sparse}
            rest = [r for r in wanted if r not in planned]
            fallback(rest)
        if sparse:
            _keep_fill_restore(logits if n == logits.shape[1] else logits[:, :n], sparse)
        return len(sparse), len(rest)

    def would_plan(self, row_bits: np.ndarray) -> bool:
        """Whether a bitmask row (int32 words) allows few enough tokens to be planned.

        Exact count, for callers that check a row once and remember: the
        per-step classification in :meth:`apply` samples instead.
        """
        return int(_set_bits(row_bits)) * SPARSE_SHARE <= 32 * row_bits.shape[-1]

    def _plan(self, row_bits: np.ndarray, n: int) -> Any:
        """The allowed token ids of one row (an int64 tensor), from the LRU or made now."""
        key = (n, row_bits.tobytes())
        with self._lock:
            ids = self._plans.get(key)
            if ids is not None:
                self._plans.move_to_end(key)
                return ids
        import torch

        allowed = np.unpackbits(row_bits.view(np.uint8), bitorder="little")[:n]
        ids = torch.from_numpy(np.flatnonzero(allowed).astype(np.int64))
        size = len(key[1]) + ids.numel() * 8
        with self._lock:
            self.plans_made += 1
            if key not in self._plans and size <= self.max_bytes:
                self._plans[key] = ids
                self._bytes += size
                while self._bytes > self.max_bytes:
                    (_, old_bits), old = self._plans.popitem(last=False)
                    self._bytes -= len(old_bits) + old.numel() * 8
        return ids


def _keep_fill_restore(view: Any, sparse: list[tuple[int, Any]]) -> None:
    """Rows sharing a plan (the same ids object from the LRU) in three tensor ops, not three per row.

    A batch in a sparse grammar has many rows and few distinct plans; per
    row, the ops' own overhead (~12 us for three) was most of the cost at
    B = 128.  Every allowed value is read before the first row is filled;
    if a put-back fails they are written back row by row, and if that fails
    too :class:`~outlines_maskcache.kernels.LogitsLost` stops a fallback
    from masking logits whose allowed values are gone (the same contract as
    the torch kernel's sparse rows).
    """
    import torch

    from outlines_maskcache.kernels import LogitsLost

    groups: dict[int, tuple[Any, list[int]]] = {}
    for r, ids in sparse:
        groups.setdefault(id(ids), (ids, []))[1].append(r)
    plans = []
    for ids, rows in groups.values():
        if len(rows) == 1:  # 1-d ops are cheaper than advanced indexing for one row
            plans.append((ids, rows, None, view[rows[0]].index_select(0, ids)))
        else:
            picked = torch.tensor(rows, dtype=torch.int64)
            plans.append((ids, rows, picked, view[(picked[:, None], ids[None, :])]))
    try:
        for ids, rows, picked, kept in plans:
            if picked is None:
                row = view[rows[0]]
                row.fill_(float("-inf"))
                row.index_copy_(0, ids, kept)
            else:
                view.index_fill_(0, picked, float("-inf"))
                view.index_put_((picked[:, None], ids[None, :]), kept)
    except Exception as err:
        try:
            for ids, rows, _, kept in plans:
                for i, r in enumerate(rows):
                    view[r][ids] = kept if kept.dim() == 1 else kept[i]
        except Exception as again:
            raise LogitsLost(f"could not restore allowed logits after {err!r}") from again
        raise


def _allowed_estimates(bits: np.ndarray, n: int) -> list[int]:
    """Per row, about how many tokens are allowed, from 64 words spread over it.

    The estimate only decides which path is faster, never what is written.
    """
    sample = bits[:, :: max(1, bits.shape[1] // SAMPLED_WORDS)]
    return (_set_bits(sample) * n // (32 * sample.shape[1])).tolist()


def _set_bits(bits: np.ndarray) -> np.ndarray:
    """Set bits per row of an int32 array (its last axis)."""
    count = getattr(np, "bitwise_count", None)
    if count is not None:
        return count(bits.view(np.uint32)).sum(axis=-1, dtype=np.int64)
    unpacked = np.unpackbits(np.ascontiguousarray(bits).view(np.uint8), axis=-1)  # numpy < 2
    return unpacked.sum(axis=-1, dtype=np.int64)


def _whole(fallback: Fallback, n_rows: int) -> tuple[int, int]:
    fallback(None)
    return 0, n_rows
