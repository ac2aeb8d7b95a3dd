"""Applying an int32 token bitmask to CPU logits: sparse rows by cached plans, the rest by the caller's kernel.

The CPU kernel engines use (xgrammar's ``apply_token_bitmask_inplace_cpu``,
which vLLM calls for every constrained row) writes ``-inf`` one blocked
token at a time, holding the GIL.  A **sparse** row (at most
``row_forms.PLAN_SPARSE_BELOW`` of the vocabulary allowed) is applied
instead by keeping the allowed logits, filling the row with ``-inf`` and
putting them back.  Planning dense rows did not pay (CHANGELOG, Removed).

A plan serves only bits equal, word for word, to the ones it was made
from.  It is found by **content** (the row's bytes key a bounded LRU) or
by **hint** (``expected``: rows the caller put into the bitmask, compared
byte for byte; a wrong hint costs time, never correctness).

Semantics are the kernel's, bit for bit, NaN included; tokens at or past
``vocab_size`` are untouched.  Every value a fill could clobber is read
before the first write; a failed fill puts them back (``LogitsLost`` if
that fails too), and the kernel's rows go last because writing ``-inf``
where a bit is 0 is idempotent.
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

#: applies the kernel to the given rows; None means the whole call, exactly as the caller made it
Fallback = Callable[[Optional[list[int]]], None]

_SPARSE, _KERNEL = "sparse", "kernel"


class Applied(NamedTuple):
    """Rows of one call, by how they were applied."""

    sparse: int
    kernel: int


class _Plan(NamedTuple):
    kind: str
    #: int64 tensor: the allowed ids (sparse); None for a kernel row
    ids: Any
    #: the hinted row object the plan was made from (None for a content-keyed plan)
    source: Any = None
    #: the hinted row's words (bytes) when the plan was made: a plan serves only these
    content: bytes = b""


class BitmaskApplier:
    """Applies sparse bitmask rows by cached keep-fill-restore plans, the others by the caller's kernel."""

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
              fallback: Fallback, expected: Sequence[np.ndarray] = (), by_content: bool = True) -> Applied:
        """Mask ``logits[r]`` by ``bitmask[r]`` for each ``r`` in ``rows`` (all rows when None).

        ``expected``: rows the caller believes are in the bitmask (int32;
        a plan is kept per row object and serves only the words it was
        made from); ``by_content``: also look for sparse rows among the
        others by their bytes.  Rows without a plan are
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
        rest = [r for r in wanted if r not in sparse_rows]
        if sparse:
            _fill_in_place(logits if n == logits.shape[1] else logits[:, :n], sparse)
        if rest:  # last: -inf where a bit is 0 is idempotent, so a failure here can redo the whole call
            fallback(rest)
        return Applied(len(sparse), len(rest))

    def would_plan(self, row_bits: np.ndarray) -> bool:
        """Whether a bitmask row (int32 words) is sparse enough to be planned.

        Exact count over the whole row, for callers that check a row once
        and remember; :meth:`apply` classifies again for its vocab_size.
        """
        return plan_kind(int(_set_bits(row_bits)), 32 * row_bits.shape[-1]) != _KERNEL

    def _hinted_plans(self, bits: np.ndarray, wanted: list[int], words: int, n: int,
                      expected: Sequence[np.ndarray]) -> dict[int, _Plan]:
        """Plans for the rows equal, word for word, to an expected row.

        A ``bytes`` comparison (a memcmp that stops at the first difference) per
        row and candidate beat a vectorised compare, whose temporaries the
        logits' matmul had evicted.
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
        ids = np.flatnonzero(allowed) if kind == _SPARSE else None
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


def _group_by_ids(pairs: Iterable[tuple[int, Any]]) -> list[tuple[Any, list[int]]]:
    """(row, ids) pairs grouped by ids object: (ids, rows), in order of first appearance.

    Plans are shared objects, so rows in one state share one ids tensor
    and one tensor op serves them all.
    """
    groups: dict[int, tuple[Any, list[int]]] = {}
    for r, ids in pairs:
        groups.setdefault(id(ids), (ids, []))[1].append(r)
    return list(groups.values())


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


def _fill_in_place(view: Any, sparse: list[tuple[int, Any]]) -> None:
    """The sparse rows' keep-fill-restore, as one step that undoes itself on failure.

    Rows sharing a plan are filled by one op: a batch in a sparse grammar has
    many rows and few plans, and per-row op overhead dominated at B = 128.
    """
    import torch

    from outlines_maskcache.kernels import write_or_restore

    neg = float("-inf")
    kept = [(rows, ids, _pick(view, rows, ids)) for ids, rows in _group_by_ids(sparse)]

    def write() -> None:
        for rows, ids, values in kept:
            if len(rows) == 1:
                view[rows[0]].fill_(neg)
            else:
                view.index_fill_(0, torch.tensor(rows, dtype=torch.int64), neg)
            _put(view, rows, ids, values)

    def restore() -> None:  # row by row: the simplest ops that can put the values back
        for rows, ids, values in kept:
            for i, r in enumerate(rows):
                view[r].index_copy_(0, ids, values if values.dim() == 1 else values[i])

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
    return Applied(0, n_rows)
