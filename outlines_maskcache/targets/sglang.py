"""Adapter for SGLang's outlines grammar backend (``--grammar-backend outlines``).

``OutlinesGrammar.fill_vocab_mask`` runs per constrained request per step
in the scheduler: it scatters ``guide.get_next_instruction(state).tokens``
(a list of up to the whole vocabulary) into a row of a (B, V) bool mask.
The row depends only on the guide (shared by every request of a schema)
and the state, so it is cached per (guide, state, device, width), built on
a miss by SGLang's own ``fill_vocab_mask`` into a scratch row; a hit is one
row copy on the device.  SGLang compiles through outlines 0.1's disk-cached
``RegexGuide.from_regex``, so no store is added here.

Loaded by SGLang's ``sglang.srt.plugins`` entry point in every process
(:func:`outlines_maskcache.plugins.sglang`); stats reach the user through
``OUTLINES_MASKCACHE_STATS_FILE``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from packaging.version import Version

from outlines_maskcache import stats_file
from outlines_maskcache.contract import Patch
from outlines_maskcache.gate import cached_or_stock, when_active
from outlines_maskcache.kernels import nbytes_of
from outlines_maskcache.outlines_core_calls import allowed_by_state
from outlines_maskcache.rows import cached_value
from outlines_maskcache.runtime import RUNTIME


def patches(module: ModuleType, version: Version) -> list[Patch]:
    grammar_cls = module.OutlinesGrammar
    stock_fill = grammar_cls.__dict__["fill_vocab_mask"]

    @when_active(stock_fill)
    def fill_vocab_mask(self: Any, vocab_mask: Any, idx: int) -> None:
        guide = self.guide
        if not allowed_by_state(guide) or getattr(vocab_mask, "dim", lambda: 0)() != 2:
            return stock_fill(self, vocab_mask, idx)
        stats_file.filled()

        def cached() -> None:
            width = vocab_mask.shape[1]
            device = vocab_mask.device

            def build() -> Any:
                # SGLang's own fill, into a scratch row of the same shape, dtype and device.
                scratch = vocab_mask.new_zeros((1, width))
                stock_fill(self, scratch, 0)
                return scratch[0]

            key = (RUNTIME.fingerprint(guide), str(device), self.state, width, str(vocab_mask.dtype), "sglang-row")
            row = cached_value(key, build, nbytes_of, _equal)
            vocab_mask[idx].copy_(row, non_blocking=True)

        # A fault before the copy leaves the row as it was; stock then overwrites it whole.
        cached_or_stock("sglang fill_vocab_mask", cached, lambda: stock_fill(self, vocab_mask, idx))

    return [Patch(grammar_cls, "fill_vocab_mask", fill_vocab_mask)]


def _equal(a: Any, b: Any) -> bool:
    import torch

    return bool(torch.equal(a, b))
