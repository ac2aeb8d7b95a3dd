"""Applying an int32 token bitmask to CPU logits: rows by cached plans, the rest by the caller's kernel.

The CPU kernel engines use to apply a packed bitmask (xgrammar's
``apply_token_bitmask_inplace_cpu``, which vLLM calls for every constrained
row of every CPU step) reads the bits and writes ``-inf`` one blocked token
at a time, on one thread, holding the GIL.  Two kinds of row do better
with a plan made once per row content (measured on this project's machine,
B = 32, 128k, fresh logits from a matmul):

* a **sparse** row (allows at most 1/``SPARSE_SHARE`` of the vocabulary:
  the kernel pays ~500 us for one allowing 1,000 tokens): keep the allowed
  logits, fill the row with ``-inf`` (a memset), put them back, ~40-60 us;
* a **dense** row (blocks at most 1/``DENSE_SHARE``: free text inside a
  JSON string, ~5,000 of 128k blocked, ~40 us a row in the kernel): the
  blocked ids of every such row of the call in one flat ``index_fill_``,
  which torch spreads over its intra-op threads, ~20 us a row.  One row
  alone is below torch's parallel grain and gains nothing, which is why
  the rows are written as one op.

A plan is found in one of two ways, and used only for bits equal, word
for word, to the ones it was made from:

* by **content**: the row's bytes key a bounded LRU.  Hashing 16 KB costs
  ~8 us a row, worth it for a sparse row, not for a dense one, so only
  rows the sampled estimate calls sparse are looked up this way;
* by **hint**: a caller that knows which rows it put into the bitmask
  (the vLLM target serves read-only cached rows) passes them as
  ``expected``; each bitmask row is compared with them byte for byte, and
  the plan is made once per hinted row object.  A wrong hint costs time,
  never correctness.

Nothing here knows which engine or grammar produced the bitmask.

Semantics are the kernel's, bit for bit, NaN included: for every listed row
and every token ``j < vocab_size`` whose bit is 0 the logit becomes
``-inf``; allowed logits are unchanged; tokens at or past ``vocab_size``
are untouched.  All plans are made, and all allowed values read, before the
first logit is written, so a failure until then leaves the logits as they
were.  The kernel's rows and the dense rows are written first: writing
``-inf`` where a bit is 0 is idempotent, so if one of those writes fails the
caller's kernel can still run over the whole call.  Only the sparse rows'
fill-and-restore is not; a failure there restores the allowed values or
raises ``LogitsLost``.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from typing import Any, Callable, Iterable, NamedTuple, Optional, Sequence

import numpy as np

#: a row is planned sparse when it allows at most 1/SPARSE_SHARE of the vocabulary: past
#: that, copying the allowed logits out and back costs more than the kernel's writes
SPARSE_SHARE = 4
#: a hinted row is planned dense when it blocks at most 1/DENSE_SHARE of the vocabulary:
#: past that its id list (8 bytes a blocked token) outweighs the kernel's bit reads
DENSE_SHARE = 8
#: words per row read to estimate how many tokens it allows
SAMPLED_WORDS = 64
#: bytes of plans (keys and ids) kept before the least recently used is dropped
DEFAULT_MAX_BYTES = 64 << 20

#: applies the kernel to the given rows; None means the whole call, exactly as the caller made it
Fallback = Callable[[Optional[list[int]]], None]

_SPARSE, _DENSE, _KERNEL = "sparse", "dense", "kernel"


class Applied(NamedTuple):
    """Rows of one call, by how they were applied."""

    sparse: int
    dense: int
    kernel: int


class _Plan(NamedTuple):
    kind: str
    #: int64 tensor: the allowed ids (sparse) or the blocked ids (dense); None for a kernel row
    ids: Any
    #: the hinted row object the plan was made from (None for a content-keyed plan)
    source: Any = None
    #: the hinted row's words (bytes) when the plan was made: a plan serves only these
    content: bytes = b""


class BitmaskApplier:
    """Applies bitmask rows by cached plans (sparse: keep-fill-restore; dense: one flat ``index_fill_``)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._plans: OrderedDict[tuple, _Plan] = OrderedDict()
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
              fallback: Fallback, expected: Sequence[np.ndarray] = (), by_content: bool = True,
              dense: bool = True) -> Applied:
        """Mask ``logits[r]`` by ``bitmask[r]`` for each ``r`` in ``rows`` (all rows when None).

        ``expected``: rows the caller believes are in the bitmask (int32;
        a plan is kept per row object and serves only the words it was
        made from); ``by_content``: also look for sparse rows among the
        others by their bytes; ``dense``: plan dense rows (else they go to
        the kernel).  Rows without a plan are
        passed, in one call, to ``fallback(rows)``, which must apply the
        same semantics; a call this cannot read as documented (rows out of
        range, shapes that disagree) goes whole to ``fallback(None)``.
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
        plans: dict[int, _Plan] = {}
        if expected:
            plans.update(self._hinted_plans(bits, wanted, words, n, expected))
        if by_content and len(plans) < len(wanted):
            unplanned = [r for r in wanted if r not in plans]
            whole = words == bits.shape[1] and unplanned == list(range(bits.shape[0]))
            estimates = _allowed_estimates(bits if whole else bits[unplanned, :words], n)
            for r, count in zip(unplanned, estimates):
                if _kind(count, n) == _SPARSE:
                    plans[r] = self._content_plan(bits[r, :words], n)
        sparse = [(r, p.ids) for r, p in plans.items() if p.kind == _SPARSE]
        groups = _dense_groups(plans) if dense else []
        column = _column_group(groups, logits.shape[0])
        flat_groups = [g for g in groups if g is not column]
        flat_logits = _flat_rows(logits) if flat_groups else None
        if flat_logits is None:
            flat_groups = []
        flat_ids = _flat_dense_ids(flat_groups, int(logits.stride(0))) if flat_groups else None
        planned = {r for r, _ in sparse}
        for _, group_rows in flat_groups + ([column] if column is not None else []):
            planned.update(group_rows)
        dense_count = len(planned) - len(sparse)
        rest = [r for r in wanted if r not in planned]
        if column is not None:  # first: the only step that touches rows it does not mask
            _fill_columns(logits, *column)
        if rest:
            fallback(rest)
        if flat_ids is not None:
            flat_logits.index_fill_(0, flat_ids, float("-inf"))
        if sparse:
            _keep_fill_restore(logits if n == logits.shape[1] else logits[:, :n], sparse)
        return Applied(len(sparse), dense_count, len(rest))

    def would_plan(self, row_bits: np.ndarray) -> bool:
        """Whether a bitmask row (int32 words) is sparse or dense enough to be planned.

        Exact count over the whole row, for callers that check a row once
        and remember; :meth:`apply` classifies again for its vocab_size.
        """
        return _kind(int(_set_bits(row_bits)), 32 * row_bits.shape[-1]) != _KERNEL

    def _hinted_plans(self, bits: np.ndarray, wanted: list[int], words: int, n: int,
                      expected: Sequence[np.ndarray]) -> dict[int, _Plan]:
        """Plans for the rows equal, word for word, to an expected row.

        One ``bytes`` comparison (a memcmp, which stops at the first
        difference) per row and candidate, most rows matching the first
        candidate they meet: ~20 us for 32 rows of 128k, where a vectorised
        compare with its temporaries took several times that once the
        logits' matmul had evicted them.
        """
        candidates = [(c[:words].tobytes(), c) for c in {id(c): c for c in expected}.values()
                      if isinstance(c, np.ndarray) and c.dtype == np.int32 and c.ndim == 1 and c.shape[0] >= words]
        if not candidates:
            return {}
        plans: list[_Plan | None] = [None] * len(candidates)
        found: dict[int, _Plan] = {}
        for r in wanted:
            content = bits[r, :words].tobytes()
            for k, (known, source) in enumerate(candidates):
                if content == known:
                    plan = plans[k]
                    if plan is None:
                        plan = plans[k] = self._plan_of_hint(source, known, n)
                    found[r] = plan
                    break
        return found

    def _plan_of_hint(self, source: np.ndarray, content: bytes, n: int) -> _Plan:
        """The plan of a hinted row whose words are ``content``, kept per row object.

        Checked against the words it was made from, not only the object: a
        caller that wrote into a row it had hinted gets a new plan, never a stale one.
        """
        key = ("hint", n, id(source))
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None and plan.source is source and plan.content == content:
                self._plans.move_to_end(key)
                return plan
        import torch

        allowed = np.unpackbits(np.frombuffer(content, dtype=np.uint8), bitorder="little")[:n].astype(bool)
        kind = _kind(int(allowed.sum()), n)
        ids = (np.flatnonzero(allowed) if kind == _SPARSE
               else np.flatnonzero(~allowed) if kind == _DENSE else None)
        plan = _Plan(kind, None if ids is None else torch.from_numpy(ids.astype(np.int64)), source, content)
        self._keep(key, plan, _size(key, plan), replace=True)
        return plan

    def _content_plan(self, row_bits: np.ndarray, n: int) -> _Plan:
        """The sparse plan of one row, keyed by its bytes, from the LRU or made now."""
        key = ("bytes", n, row_bits.tobytes())
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                return plan
        import torch

        allowed = np.unpackbits(row_bits.view(np.uint8), bitorder="little")[:n]
        plan = _Plan(_SPARSE, torch.from_numpy(np.flatnonzero(allowed).astype(np.int64)), None)
        self._keep(key, plan, _size(key, plan))
        return plan

    def _keep(self, key: tuple, plan: _Plan, size: int, replace: bool = False) -> None:
        with self._lock:
            self.plans_made += 1
            if replace and key in self._plans:
                self._bytes -= _size(key, self._plans.pop(key))
            if key in self._plans or size > self.max_bytes:
                return
            self._plans[key] = plan
            self._bytes += size
            while self._bytes > self.max_bytes:
                old_key, old = self._plans.popitem(last=False)
                self._bytes -= _size(old_key, old)


def _size(key: tuple, plan: _Plan) -> int:
    ids = 0 if plan.ids is None else plan.ids.numel() * 8
    return (len(key[2]) if key[0] == "bytes" else int(plan.source.nbytes) + len(plan.content)) + ids


def _flat_rows(logits: Any) -> Any:
    """The logits' rows as one 1-d view of their storage (row padding included), or None.

    vLLM's CPU logits are rows of a wider buffer (128,257 columns with a
    stride of 128,320); only positions ``r * stride + j`` with ``j`` below
    the width are ever written through it.
    """
    rows, width = logits.shape
    if logits.stride(1) != 1 or (rows > 1 and logits.stride(0) < width):
        return None
    return logits.as_strided(((rows - 1) * logits.stride(0) + width,), (1,))


def _kind(allowed: int, n: int) -> str:
    """How a row allowing ``allowed`` of ``n`` tokens is applied: sparse, dense or by the kernel."""
    if allowed * SPARSE_SHARE <= n:
        return _SPARSE
    return _DENSE if (n - allowed) * DENSE_SHARE <= n else _KERNEL


def _group_by_ids(pairs: Iterable[tuple[int, Any]]) -> list[tuple[Any, list[int]]]:
    """(row, ids) pairs grouped by ids object: (ids, rows), in order of first appearance.

    Plans are shared objects, so rows in one state share one ids tensor
    and one tensor op serves them all.
    """
    groups: dict[int, tuple[Any, list[int]]] = {}
    for r, ids in pairs:
        groups.setdefault(id(ids), (ids, []))[1].append(r)
    return list(groups.values())


def _dense_groups(plans: dict[int, _Plan]) -> list[tuple[Any, list[int]]]:
    """Dense rows grouped by plan: (blocked ids, rows), largest group first."""
    groups = _group_by_ids((r, p.ids) for r, p in plans.items() if p.kind == _DENSE)
    return sorted(groups, key=lambda g: -len(g[1]))


def _column_group(groups: list[tuple[Any, list[int]]], n_rows: int) -> tuple[Any, list[int]] | None:
    """The dense group worth writing as whole columns (``index_fill_`` on dim 1), if any.

    Filling the blocked columns of every row needs no per-step index
    (building the flat one for 32 rows of 128k costs ~190 us once the
    matmul has evicted the caches) but hits the rows outside the group,
    whose values there are saved first and put back: worth it while those
    are at most half as many as the group's.
    """
    if not groups:
        return None
    rows = groups[0][1]
    return groups[0] if 2 * (n_rows - len(rows)) <= len(rows) else None


def _fill_columns(logits: Any, ids: Any, rows: list[int]) -> None:
    """Write -inf to columns ``ids`` of ``rows``: every row's columns, the others' values put back.

    The others' values are read before the first write; if a write or the
    put-back fails they are written back row by row, and if that fails too
    :class:`~outlines_maskcache.kernels.LogitsLost` stops a fallback from
    masking rows whose values are gone.  Once this returns, the only change
    is ``-inf`` on blocked tokens of the group's rows, which the caller's
    kernel would write too.
    """
    import torch

    from outlines_maskcache.kernels import LogitsLost

    group = set(rows)
    others = torch.tensor([r for r in range(logits.shape[0]) if r not in group], dtype=torch.int64)
    kept = logits[(others[:, None], ids[None, :])] if len(others) else None
    try:
        logits.index_fill_(1, ids, float("-inf"))
        if kept is not None:
            logits.index_put_((others[:, None], ids[None, :]), kept)
    except Exception as err:
        try:
            if kept is not None:
                for i, r in enumerate(others.tolist()):
                    logits[r].index_copy_(0, ids, kept[i])
        except Exception as again:
            raise LogitsLost(f"could not restore the logits of rows outside the mask after {err!r}") from again
        raise


def _flat_dense_ids(groups: list[tuple[Any, list[int]]], stride: int) -> Any:
    """The groups' blocked ids as positions in the flattened logits."""
    import torch

    parts = [(torch.tensor(rows, dtype=torch.int64)[:, None] * stride + ids[None, :]).reshape(-1)
             for ids, rows in groups]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _keep_fill_restore(view: Any, sparse: list[tuple[int, Any]]) -> None:
    """Rows sharing a plan (the same ids object) in three tensor ops, not three per row.

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

    plans = []
    for ids, rows in _group_by_ids(sparse):
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


def _whole(fallback: Fallback, n_rows: int) -> Applied:
    fallback(None)
    return Applied(0, 0, n_rows)
