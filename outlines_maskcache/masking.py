"""The per-step algorithm every adapter shares: states in, masked logits out.

An adapter knows how to read each row's FSM state and how to write the stock
allowed-token vector for a row; this module does the rest (cache keys,
lookups, validation, verification, application) so no adapter repeats it.

A :class:`Masker` lives on one logits processor for its whole life.  It keeps
what is the same from one decoding step to the next (the kernel and the
key's placement for the logits' device, dtype and width; which rows it
already validated; the kernel's scratch buffers), so a warm step costs one
lock round-trip, a dict lookup per distinct state and the tensor work.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence, TypeVar

import numpy as np

from outlines_maskcache.kernels import Kernel, LogitsLost, kernel_for
from outlines_maskcache.persisted_masks import words_of
from outlines_maskcache.runtime import RUNTIME

T = TypeVar("T")

#: attribute under which a processor carries its :class:`Masker`
ATTRIBUTE = "_outlines_maskcache"


class Masker:
    """Masks one processor's logits, step after step, with cached per-state rows.

    Rows validated on an earlier step are recognised by identity: the cache
    hands out the object it stores, so ``found is known`` proves the row was
    checked against this placement before.  Only the rows of the latest step
    are remembered (and the kernel's slate holds at most two per batch row),
    so what a masker keeps alive past the cache's own eviction is bounded by
    the batch, not by the grammar.
    """

    __slots__ = ("grammar", "_signature", "_kernel", "_placement", "_fingerprint", "_known", "_scratch")

    def __init__(self, grammar: Any) -> None:
        self.grammar = grammar
        self._signature: tuple | None = None
        self._kernel: Kernel | None = None
        self._placement: tuple[Hashable, Hashable, str] = ("", "", "")
        #: (registry generation, fingerprint) last read for ``grammar``
        self._fingerprint: tuple[int, Any] = (-1, None)
        self._known: dict[Hashable, Any] = {}
        #: per-processor buffers a kernel may keep between steps (CPU slate)
        self._scratch: dict[str, Any] = {}

    def __call__(self, states: Sequence[Hashable], logits: Any, allowed_of: Callable[[int], np.ndarray],
                 kernel: Kernel | None = None) -> Any:
        """Mask row ``i`` of *logits* (B, V) with the cached row for ``states[i]``.

        *allowed_of(i)* must return stock's allowed-token vector (bool, length
        V) for row ``i`` in its current state; it runs only on a miss (or,
        with ``verify=True``, to check every served row).
        """
        runtime = RUNTIME
        settings = runtime.settings
        shape = logits.shape
        if len(shape) != 2 or shape[0] != len(states):
            raise ValueError(f"logits of shape {tuple(shape)} do not match {len(states)} states")
        width = shape[1]
        signature = (logits.dtype, getattr(logits, "device", None), width, settings.form, kernel)
        if signature != self._signature:
            self._bind(signature, logits, settings.form, kernel)
        kernel = self._kernel
        assert kernel is not None
        device, dtype, form = self._placement
        generation, fingerprint = self._fingerprint
        if generation != runtime.grammars.generation:
            # Only when some grammar was forgotten: ours may have been, and
            # asking again also marks it as in use.
            generation = runtime.grammars.generation
            fingerprint = runtime.fingerprint(self.grammar)
            self._fingerprint = (generation, fingerprint)
        cache = runtime.cache
        distinct = list(dict.fromkeys(states)) if len(states) > 1 else states
        keys = [(fingerprint, device, state, width, dtype, form) for state in distinct]
        found = cache.get_many(keys)
        known = self._known
        verify = settings.verify
        served: dict[Hashable, Any] = {}
        for state, key, row in zip(distinct, keys, found):
            if row is not None and (verify or row is not known.get(state)) and not kernel.valid(row, form, logits):
                cache.reject(key)
                row = None
            if row is None:
                fresh = kernel.row(allowed_of(states.index(state)), form, logits, settings.sparse_below)
                row = cache.put(key, fresh, kernel.nbytes(fresh))
            elif verify:
                fresh = kernel.row(allowed_of(states.index(state)), form, logits, settings.sparse_below)
                verify_served(key, row, fresh, kernel.equal)
            served[state] = row
        self._known = served
        rows = [served[state] for state in states]
        # Verification checks the rows themselves, so apply those and no copy of them.
        return kernel.apply(logits, rows, form, settings.nan_guard, None if verify else self._scratch)

    def _bind(self, signature: tuple, logits: Any, form: str, kernel: Kernel | None) -> None:
        """Placement for a new kind of logits: computed once, not every step."""
        kernel = kernel or kernel_for(logits)
        if kernel is None:
            raise TypeError(f"no mask kernel for logits of type {type(logits).__name__}")
        self._kernel = kernel
        self._placement = kernel.placement(logits, form)
        self._known = {}
        self._scratch = {}
        self._signature = signature


def cached_value(key: tuple, build: Callable[[], T], nbytes: Callable[[T], int], equal: Callable[[Any, Any], bool]) -> T:
    """The cache's value for *key* (built by the engine's own code on a miss); checked against a rebuild with ``verify=True``.

    For adapters whose engine fills a whole mask row itself (vLLM's bitmask,
    SGLang's bool mask): the row is the engine's own output for the state,
    so serving it again is exact.
    """
    value = RUNTIME.cache.get_or_build(key, build, nbytes)
    if RUNTIME.settings.verify:
        verify_served(key, value, build(), equal)
    return value


def bitmask_row(fingerprint: Any, guide: Any, n_words: int) -> np.ndarray:
    """The int32 bitmask row of *guide*'s current state: cached, or written by stock's call and cached.

    The row engines fill with ``Guide.write_mask_into`` (vLLM's bitmask,
    MaskBench's engines); it depends only on the grammar named by
    *fingerprint* and the state (and, for a content-named grammar, is
    persisted beside it: :mod:`outlines_maskcache.persisted_masks`).  Rows
    are read-only so a served row can never be changed in place by a caller.
    """
    state = guide.get_state()
    key = (fingerprint, "cpu", state, n_words, "bitmask-i32")
    # With verify=True, words_of itself checks a persisted row against a fresh write.
    return cached_value(key, lambda: words_of(fingerprint, guide, n_words, state), _row_bytes, np.array_equal)


def _row_bytes(row: Any) -> int:
    return int(row.nbytes) if hasattr(row, "nbytes") else int(row.numel() * row.element_size())


def masker_of(processor: Any, grammar: Any) -> Masker:
    """The processor's masker, made on first use or when its grammar object changed."""
    masker = processor.__dict__.get(ATTRIBUTE)
    if masker is None or masker.grammar is not grammar:
        masker = Masker(grammar)
        setattr(processor, ATTRIBUTE, masker)
    return masker


def verify_served(key: tuple, served: Any, fresh: Any, equal: Callable[[Any, Any], bool]) -> None:
    """``verify=True``: a served mask must equal a fresh build.

    A mismatch drops the entry and raises, so the adapter runs stock for the
    step: a corrupted row is never applied.
    """
    cache = RUNTIME.cache
    if not equal(served, fresh):
        cache.reject(key)
        raise AssertionError(f"cached mask for state {key[2]!r} differs from a fresh build")
    cache.count("verified")


def cached_or_stock(where: str, cached: Callable[[], T], stock: Callable[[], T]) -> T:
    """Run the cached path; on any fault run the stock one instead.

    Safe because every cached application is idempotent under the stock one
    that follows: allowed logits are untouched, blocked ones are -inf (or NaN
    that stock then overwrites with -inf), so a half-applied batch re-masked
    by stock equals stock.  The one exception is a sparse row caught between
    its fill and its put-back; the kernel repairs that itself or raises
    :class:`~outlines_maskcache.kernels.LogitsLost`, which is re-raised here.
    """
    try:
        return cached()
    except LogitsLost as err:  # the logits are damaged: stock would mask garbage
        RUNTIME.fault(where, err)
        raise
    except Exception as err:  # noqa: BLE001 - any fault must reach stock, never the logits
        RUNTIME.fault(where, err)
        return stock()
