"""Whole mask rows for engines that fill their own (vLLM's int32 bitmask, SGLang's bool mask).

The engine's own fill of a state is its output for that state, so the
row it wrote once is served again for every later visit; a row read from
outlines_core is also persisted beside its grammar
(:mod:`outlines_maskcache.persisted_masks`).
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import numpy as np

from outlines_maskcache.gate import verify_served
from outlines_maskcache.kernels import nbytes_of
from outlines_maskcache.persisted_masks import words_of
from outlines_maskcache.runtime import RUNTIME

T = TypeVar("T")


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
    return cached_value(key, lambda: words_of(fingerprint, guide, n_words, state), nbytes_of, np.array_equal)
