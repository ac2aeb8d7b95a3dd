"""The per-step algorithm every adapter shares: states in, masked logits out.

An adapter knows how to read each row's FSM state and how to write the stock
allowed-token vector for a row; this module does the rest (cache keys,
lookups, verification, application) so no adapter repeats it.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence, TypeVar

import numpy as np

from outlines_maskcache.kernels import Kernel, kernel_for
from outlines_maskcache.runtime import RUNTIME

T = TypeVar("T")


def mask_logits(
    grammar: Any,
    states: Sequence[Hashable],
    logits: Any,
    allowed_of: Callable[[int], np.ndarray],
    kernel: Kernel | None = None,
) -> Any:
    """Mask row ``i`` of *logits* (B, V) with the cached row for ``states[i]``.

    *allowed_of(i)* must return stock's allowed-token vector (bool, length V)
    for row ``i`` in its current state; it is only called on a miss (or, with
    ``verify=True``, to check a hit).
    """
    runtime = RUNTIME
    settings = runtime.settings
    kernel = kernel or kernel_for(logits)
    if kernel is None:
        raise TypeError(f"no mask kernel for logits of type {type(logits).__name__}")
    if len(logits.shape) != 2 or logits.shape[0] != len(states):
        raise ValueError(f"logits of shape {tuple(logits.shape)} do not match {len(states)} states")
    fingerprint = runtime.fingerprint(grammar)
    device, dtype, form = kernel.placement(logits, settings.form)
    width = int(logits.shape[1])
    cache = runtime.cache
    first_row: dict[Hashable, int] = {}
    for i, state in enumerate(states):
        first_row.setdefault(state, i)
    keys = [(fingerprint, device, state, width, dtype, form) for state in first_row]
    found = cache.get_many(keys)
    by_state: dict[Hashable, Any] = {}
    hits = 0
    for key, row in zip(keys, found):
        state = key[2]
        i = first_row[state]
        if row is not None and kernel.valid(row, form, logits):
            hits += 1
        else:
            if row is not None:
                cache.discard(key)
            row = cache.get_or_build(key, lambda i=i: kernel.row(allowed_of(i), form, logits), kernel.nbytes)
        if settings.verify:
            verify_served(key, row, kernel.row(allowed_of(i), form, logits), kernel.equal)
        by_state[state] = row
    if hits:
        cache.count("hits", hits)
    rows = [by_state[state] for state in states]
    return kernel.apply(logits, rows, form, settings.nan_guard)


def verify_served(key: tuple, served: Any, fresh: Any, equal: Callable[[Any, Any], bool]) -> None:
    """``verify=True``: a served mask must equal a fresh build.

    A mismatch drops the entry and raises, so ``cached_or_stock`` runs stock
    for the step: a corrupted row is never applied.
    """
    cache = RUNTIME.cache
    if not equal(served, fresh):
        cache.discard(key)
        raise AssertionError(f"cached mask for state {key[2]!r} differs from a fresh build")
    cache.count("verified")


def cached_or_stock(where: str, cached: Callable[[], T], stock: Callable[[], T]) -> T:
    """Run the cached path; on any fault run the stock one instead.

    Safe because every cached application is idempotent under the stock one
    that follows: allowed logits are untouched, blocked ones are -inf (or NaN
    that stock then overwrites with -inf), so a half-applied batch re-masked
    by stock equals stock.
    """
    try:
        return cached()
    except Exception as err:  # noqa: BLE001 - any fault must reach stock, never the logits
        RUNTIME.fault(where, err)
        return stock()
