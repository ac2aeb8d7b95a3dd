"""Adapter for SGLang's outlines grammar backend (``--grammar-backend outlines``).

``sglang.srt.constrained.outlines_backend.OutlinesGrammar.fill_vocab_mask``
runs per constrained request per step in the scheduler process: it builds a
tensor from ``guide.get_next_instruction(state).tokens`` (a Python list of
up to the whole vocabulary), copies it to the mask's device and scatters it
into a row of a (B, V) bool mask (True = blocked).  The row depends only on
the compiled guide and the state, and SGLang shares one guide between all
requests with the same schema (its grammar cache hands each request a
``copy()``), so the row is cached per (guide, state, device, width) — built
on a miss by SGLang's own ``fill_vocab_mask`` into a scratch row, so it is
SGLang's result by construction — and a hit is one device-side row copy.
``fill_vocab_mask_batched`` (a loop over rows) reaches it per row.

Compiled guides: SGLang compiles with outlines 0.1's ``RegexGuide.from_regex``,
whose ``create_states_mapping`` outlines itself caches on disk, so this
target adds no store of its own.

Loaded through SGLang's ``sglang.srt.plugins`` entry point
(:func:`outlines_maskcache.plugins.sglang`), which SGLang (0.5.11 and
later) calls in every process it starts, the scheduler included (honour
``SGLANG_PLUGINS`` if set).  Older SGLang starts its scheduler with no
plugin hook; they are not supported (see docs/versions.md).  Stats reach the
user through ``OUTLINES_MASKCACHE_STATS_FILE`` (:mod:`outlines_maskcache.stats_file`).
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
