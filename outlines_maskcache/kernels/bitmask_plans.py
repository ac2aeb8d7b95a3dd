"""Applying an int32 token bitmask to CPU logits: rows by cached plans, the rest by the caller's kernel.

The CPU kernel engines use to apply a packed bitmask (xgrammar's
``apply_token_bitmask_inplace_cpu``, which vLLM calls for every constrained
row of every CPU step) reads the bits and writes ``-inf`` one blocked token
at a time, on one thread, holding the GIL.  Two kinds of row do better
with a plan made once per row content (measured on this project's machine,
B = 32, 128k, fresh logits from a matmul):

* a **sparse** row (allows at most ``PLAN_SPARSE_BELOW`` of the vocabulary:
  the kernel pays ~500 us for one allowing 1,000 tokens): keep the allowed
  logits, fill the row with ``-inf`` (a memset), put them back, ~40-60 us;
* a **dense** row (blocks at most ``PLAN_DENSE_BELOW``: free text inside a
  JSON string, ~5,000 of 128k blocked, ~40 us a row in the kernel): when
  most of the batch sits in such states, the largest group's blocked ids
  are written down every row of the logits at once
  (``logits.t().index_fill_``, on torch's intra-op threads, ~15 us a row),
  and the rows that must not get them are put right: a sparse row is
  rewritten anyway, a row of another dense state gets only the few ids
  the two differ in, any other row has its values there put back.  That
  touches the logits about as much as one read-write pass over them,
  the floor for an exact mask.

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
are untouched.  All plans are made, and every value a write could clobber
is read, before the first logit is written.  If the column write or a
sparse fill fails, those values are put back, which leaves only ``-inf``
where a bit is 0, so the caller's kernel can still run over the whole
call; if putting back fails too, ``LogitsLost`` says so.  The kernel's own
rows go last: writing ``-inf`` where a bit is 0 is idempotent.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from typing import Any, Callable, Iterable, NamedTuple, Optional, Sequence

import numpy as np

from outlines_maskcache.row_forms import plan_kind

#: words per row read to estimate how many tokens it allows
SAMPLED_WORDS = 64
#: bytes of plans (keys and ids) kept before the least recently used is dropped
DEFAULT_MAX_BYTES = 64 << 20
#: a blocked id written down a column costs about this many times a token read by the kernel
#: (B = 32, 128k: ~3 ns an id and row against ~0.3 ns a token; docs/benchmarks.md)
COLUMN_COST = 10
#: pairs of dense plans whose difference is kept (a JSON schema has a few string states)
MAX_DIFFERENCES = 256

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
    """Applies bitmask rows by cached plans (sparse: keep-fill-restore; dense: one column write)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._plans: OrderedDict[tuple, _Plan] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        #: (id(ids), id(other)) -> (ids, other, what ids blocks that other allows, what other blocks beyond ids)
        self._differences: dict[tuple[int, int], tuple[Any, Any, Any, Any]] = {}
        #: plans made (misses of the LRU)
        self.plans_made = 0

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()
            self._differences.clear()
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
                if plan_kind(count, n) == _SPARSE:
                    plans[r] = self._content_plan(bits[r, :words], n)
        sparse = [(r, p.ids) for r, p in plans.items() if p.kind == _SPARSE]
        sparse_rows = {r for r, _ in sparse}
        dense_plans = {r: p for r, p in plans.items() if p.kind == _DENSE} if dense else {}
        route = _column_route(dense_plans, sparse_rows, n_rows, n, self._difference) if dense_plans else None
        covered = route.covered if route is not None else set()
        rest = [r for r in wanted if r not in sparse_rows and r not in covered]
        if route is not None or sparse:
            _write_in_place(logits, logits if n == logits.shape[1] else logits[:, :n], route, sparse)
        if rest:  # last: -inf where a bit is 0 is idempotent, so a failure here can redo the whole call
            fallback(rest)
        return Applied(len(sparse), len(covered), len(rest))

    def would_plan(self, row_bits: np.ndarray) -> bool:
        """Whether a bitmask row (int32 words) is sparse or dense enough to be planned.

        Exact count over the whole row, for callers that check a row once
        and remember; :meth:`apply` classifies again for its vocab_size.
        """
        return plan_kind(int(_set_bits(row_bits)), 32 * row_bits.shape[-1]) != _KERNEL

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
        kind = plan_kind(int(allowed.sum()), n)
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

    def _difference(self, ids: Any, other: Any) -> tuple[Any, Any]:
        """Two dense plans' blocked ids, compared once per pair of plans: (ids - other, other - ids).

        Held with both tensors and checked by identity, so an id reused by
        a new tensor after the old one was freed can never match.
        """
        key = (id(ids), id(other))
        with self._lock:
            known = self._differences.get(key)
        if known is not None and known[0] is ids and known[1] is other:
            return known[2], known[3]
        import torch

        a, b = ids.numpy(), other.numpy()
        only_ids = torch.from_numpy(np.setdiff1d(a, b, assume_unique=True).astype(np.int64))
        only_other = torch.from_numpy(np.setdiff1d(b, a, assume_unique=True).astype(np.int64))
        with self._lock:
            if len(self._differences) >= MAX_DIFFERENCES:
                self._differences.clear()
            self._differences[key] = (ids, other, only_ids, only_other)
        return only_ids, only_other

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


def _group_by_ids(pairs: Iterable[tuple[int, Any]]) -> list[tuple[Any, list[int]]]:
    """(row, ids) pairs grouped by ids object: (ids, rows), in order of first appearance.

    Plans are shared objects, so rows in one state share one ids tensor
    and one tensor op serves them all.
    """
    groups: dict[int, tuple[Any, list[int]]] = {}
    for r, ids in pairs:
        groups.setdefault(id(ids), (ids, []))[1].append(r)
    return list(groups.values())


class _Route(NamedTuple):
    """One column write of ``ids`` down every row of the logits, and what puts the other rows right."""

    ids: Any
    #: rows the write masks exactly: the group's, and other dense rows once corrected
    covered: set[int]
    #: (rows, ids): rows whose values at ids are read before the write and put back after
    restore: list[tuple[list[int], Any]]
    #: (rows, ids): other dense rows' blocked ids that the column write missed
    extra: list[tuple[list[int], Any]]


def _column_route(dense: dict[int, _Plan], sparse_rows: set[int], n_rows: int, n: int,
                  diff: Callable[[Any, Any], tuple[Any, Any]]) -> _Route | None:
    """Whether the largest dense group's blocked columns, written down every row, beat the kernel.

    Written on the transposed logits (``logits.t().index_fill_(0, ids)``),
    the column write costs ~15 us a row at 128k and B = 32, needs no
    per-step index (a flat one for 32 rows took ~190 us to build once the
    matmul had evicted the caches, and its 1.2 MB allocation made the write
    itself vary 2x from run to run), but it lands on every row:

    * a sparse row is filled and restored afterwards anyway: free;
    * a row of another dense plan (the string of another JSON field: a few
      dozen tokens differ) gets only the difference: the group's ids it
      allows are put back, its own the write missed are written (unless
      the two differ in more than half as many ids as the group blocks);
    * any other row (the kernel's, or one the call does not mask) has every
      value under the group's ids put back, ~50 us a row.

    The kernel reads every word of a row (~40 us at 128k, ~0.3 ns a token)
    where the column write costs ~3 ns per blocked id and row, and putting
    a row back about twice that again; so the write pays when
    ``COLUMN_COST * ids * (n_rows + 3 * others) <= n * covered``.
    """
    groups = sorted(_group_by_ids((r, p.ids) for r, p in dense.items()), key=lambda g: -len(g[1]))
    if not groups:
        return None
    ids = groups[0][0]
    covered = set(groups[0][1])
    restore: list[tuple[list[int], Any]] = []
    extra: list[tuple[list[int], Any]] = []
    for other_ids, rows in groups[1:]:
        allowed_here, missed = diff(ids, other_ids)
        if 2 * (allowed_here.numel() + missed.numel()) > ids.numel():
            continue  # too unlike: the kernel's, with its values under ids put back
        covered.update(rows)
        if allowed_here.numel():
            restore.append((rows, allowed_here))
        if missed.numel():
            extra.append((rows, missed))
    others = [r for r in range(n_rows) if r not in covered and r not in sparse_rows]
    if COLUMN_COST * ids.numel() * (n_rows + 3 * len(others)) > n * len(covered):
        return None
    if others:
        restore.append((others, ids))
    return _Route(ids, covered, restore, extra)


def _pick(view: Any, rows: list[int], ids: Any) -> Any:
    """``view[rows][:, ids]`` as a copy: 1-d ops for one row (cheaper than advanced indexing)."""
    if len(rows) == 1:
        return view[rows[0]].index_select(0, ids)
    import torch

    picked = torch.tensor(rows, dtype=torch.int64)
    return view[(picked[:, None], ids[None, :])]


def _put(view: Any, rows: list[int], ids: Any, values: Any) -> None:
    if len(rows) == 1:
        view[rows[0]].index_copy_(0, ids, values)
    else:
        import torch

        picked = torch.tensor(rows, dtype=torch.int64)
        view.index_put_((picked[:, None], ids[None, :]), values)


def _write_in_place(logits: Any, view: Any, route: _Route | None, sparse: list[tuple[int, Any]]) -> None:
    """The column write and the sparse rows' fill-and-restore, as one step that undoes itself on failure.

    Every value either step must keep (the sparse rows' allowed logits,
    the values under the column ids of rows the write must not mask) is
    read before the first write.  Sparse rows sharing a plan are filled in
    one op, not one per row: a batch in a sparse grammar has many rows and
    few distinct plans, and per row the ops' own overhead (~12 us for
    three) was most of the cost at B = 128.  If a write fails, every kept
    value is put back, which leaves only ``-inf`` on tokens the bitmask
    blocks, so the caller's kernel can redo the whole call; if putting back
    fails too, :class:`~outlines_maskcache.kernels.LogitsLost` stops a
    fallback from masking logits whose values are gone.
    """
    import torch

    from outlines_maskcache.kernels import write_or_restore

    neg = float("-inf")
    kept_sparse = [(rows, ids, _pick(view, rows, ids)) for ids, rows in _group_by_ids(sparse)]
    kept_route = [(rows, ids, _pick(logits, rows, ids)) for rows, ids in route.restore] if route else []

    def write() -> None:
        if route is not None:
            logits.t().index_fill_(0, route.ids, neg)
            for rows, ids, values in kept_route:
                _put(logits, rows, ids, values)
            for rows, ids in route.extra:
                for r in rows:
                    logits[r].index_fill_(0, ids, neg)
        for rows, ids, values in kept_sparse:
            if len(rows) == 1:
                view[rows[0]].fill_(neg)
            else:
                view.index_fill_(0, torch.tensor(rows, dtype=torch.int64), neg)
            _put(view, rows, ids, values)

    def restore() -> None:  # row by row: the simplest ops that can put the values back
        for target, kept in ((logits, kept_route), (view, kept_sparse)):
            for rows, ids, values in kept:
                for i, r in enumerate(rows):
                    target[r].index_copy_(0, ids, values if values.dim() == 1 else values[i])

    write_or_restore(write, restore)


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
