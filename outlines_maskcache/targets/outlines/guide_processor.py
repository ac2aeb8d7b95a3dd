"""Adapter for the outlines 0.1-1.1 line: ``outlines.processors.structured.GuideLogitsProcessor``.

Two layouts of one algorithm: 0.1.1-0.2.x masks torch logits in place;
1.0-1.1 goes through a ``tensor_adapter`` and masks out of place.  Patched:

* ``GuideLogitsProcessor.process_logits``: each row's state comes from
  stock's own prefix-hash table (``_guide_states``, ``_seq_start_idx``),
  filled as stock fills it; the masks come from the cache.
  ``CFGLogitsProcessor`` overrides ``process_logits`` and stays stock, as
  does any guide whose allowed tokens are not a function of its state.
* ``RegexGuide.from_regex``: memoized, because every ``generate.json`` /
  ``Generator`` call compiles a new guide, which would leave the mask
  cache cold.  A ``RegexGuide`` holds no per-generation state (its
  ``copy()`` returns ``self``), so sharing one changes no result.

0.1.0 is not patched (docs/versions.md).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, Hashable

import numpy as np
from packaging.version import Version

from outlines_maskcache import compiled
from outlines_maskcache.contract import Patch
from outlines_maskcache.fingerprint import vocabulary_hash
from outlines_maskcache.gate import cached_or_stock, when_active
from outlines_maskcache.kernels import Kernel, allowed_from_ids, kernel_for
from outlines_maskcache.masker import masker_of
from outlines_maskcache.outlines_core_calls import allowed_by_state, instruction_ids
from outlines_maskcache.runtime import RUNTIME

#: Kernels whose result matches stock's dtype on the out-of-place (1.x)
#: layout.  Stock's mlx adapter writes ``mx.where(mask, mx.array(-inf), x)``,
#: which promotes bf16/fp16 logits to float32; ours would keep the dtype.
_OUT_OF_PLACE_KERNELS = ("torch", "numpy")


def _states(processor: Any, input_ids: Any, to_list: Callable[[Any], list]) -> list[Hashable]:
    """Each row's guide state, filling ``_guide_states`` exactly as stock does.

    Stock keys the table by ``hash(tuple(generated ids))`` and, on a miss,
    advances from the entry of the prefix one token shorter.  The only change
    is one ``to_list`` for the whole batch instead of two per row: both give
    the same Python ints, so keys, lookups and ``get_next_state`` calls are
    the same.  The hash itself is not made incremental: CPython exposes no
    running tuple hash, and the table must collide exactly where stock's does.
    """
    if processor._seq_start_idx is None:
        processor._seq_start_idx = len(input_ids[0])
    start = processor._seq_start_idx
    table = processor._guide_states
    guide = processor.guide
    states: list[Hashable] = []
    for row in to_list(input_ids):
        generated = row[start:]
        key = hash(tuple(generated))
        if key not in table:
            previous = table[hash(tuple(generated[:-1]))]
            table[key] = guide.get_next_state(previous, generated[-1])
        states.append(table[key])
    return states


def _allowed_reader(guide: Any, states: list[Hashable], width: int) -> Callable[[int], np.ndarray]:
    def allowed_of(i: int) -> np.ndarray:
        # The same call stock makes for the row; only run on a cache miss.
        return allowed_from_ids(instruction_ids(guide.get_next_instruction(states[i]).tokens), width)

    return allowed_of


def _private_copy(logits: Any) -> Any:
    """A copy to mask in place, for the layout whose stock leaves its input untouched."""
    if isinstance(logits, np.ndarray):
        return logits.copy()
    return logits.clone()


def patches(module: ModuleType, version: Version) -> list[Patch]:
    processor_cls = module.GuideLogitsProcessor
    guide_cls = module.RegexGuide
    stock_process = processor_cls.__dict__["process_logits"]
    stock_from_regex = guide_cls.__dict__["from_regex"]

    def kernel_of(processor: Any, logits: Any) -> Kernel | None:
        kernel = kernel_for(logits)
        if kernel is None:
            return None
        if getattr(processor, "tensor_adapter", None) is not None and kernel.name not in _OUT_OF_PLACE_KERNELS:
            return None
        return kernel

    @when_active(stock_process)
    def process_logits(self: Any, input_ids: Any, logits: Any) -> Any:
        kernel = kernel_of(self, logits)
        if kernel is None or not allowed_by_state(self.guide):
            return stock_process(self, input_ids, logits)
        adapter = getattr(self, "tensor_adapter", None)

        def cached() -> Any:
            to_list = adapter.to_list if adapter is not None else (lambda t: t.tolist())
            states = _states(self, input_ids, to_list)
            target = logits if adapter is None else _private_copy(logits)
            reader = _allowed_reader(self.guide, states, int(logits.shape[1]))
            return masker_of(self, self.guide)(states, target, reader, kernel)

        # A fault after the state table was filled is harmless: stock finds
        # the same entries it would have written.  On the in-place layout a
        # half-masked batch re-masked by stock equals stock (cached_or_stock).
        return cached_or_stock("guide processor mask", cached, lambda: stock_process(self, input_ids, logits))

    def from_regex(cls: type, regex_string: str, tokenizer: Any, **kwargs: Any) -> Any:
        stock = stock_from_regex.__get__(None, cls)
        if not RUNTIME.active() or kwargs or cls is not guide_cls:
            return stock(regex_string, tokenizer, **kwargs)
        # The guide reads the tokenizer's vocabulary, special tokens,
        # convert_token_to_string and eos id; the identity covers all of
        # them, the content parts catch a tokenizer mutated in place.
        return compiled.memoized(
            "guide memo key",
            lambda: ("regex-guide", RUNTIME.fingerprint(tokenizer), tokenizer.eos_token_id,
                     vocabulary_hash(tokenizer.vocabulary), regex_string),
            lambda key: stock(regex_string, tokenizer),
            lambda: stock(regex_string, tokenizer),
        )

    return [
        Patch(processor_cls, "process_logits", process_logits),
        Patch(guide_cls, "from_regex", classmethod(from_regex)),
    ]
