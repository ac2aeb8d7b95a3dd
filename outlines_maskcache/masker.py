"""Masking a logits processor's batch, step after step, with cached per-state rows.

An adapter knows how to read each row's FSM state and how to write the stock
allowed-token vector for a row; a :class:`Masker` does the rest (cache keys,
lookups, validation, verification, application) so no adapter repeats it.

A masker lives on one logits processor for its whole life.  It keeps what
is the same from one decoding step to the next (the kernel and the key's
placement for the logits' device, dtype and width; which rows it already
validated; the kernel's scratch buffers), so a warm step costs one lock
round-trip, a dict lookup per distinct state and the tensor work.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence

import numpy as np

from outlines_maskcache.gate import verify_served
from outlines_maskcache.kernels import Kernel, kernel_for
from outlines_maskcache.runtime import RUNTIME

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


def masker_of(processor: Any, grammar: Any) -> Masker:
    """The processor's masker, made on first use or when its grammar object changed."""
    masker = processor.__dict__.get(ATTRIBUTE)
    if masker is None or masker.grammar is not grammar:
        masker = Masker(grammar)
        setattr(processor, ATTRIBUTE, masker)
    return masker
