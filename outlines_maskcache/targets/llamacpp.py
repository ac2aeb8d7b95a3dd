"""Adapter for llama-cpp-python's logits-processor hook (``llama_cpp._internals.LlamaSampler.add_custom``).

``Llama._init_sampler`` wraps the processors, for every generation, in a
closure (``apply_func``) that builds a new ``np.dtype`` and ``np.recarray``
over the C candidate array per token: more than a warm cached mask costs
(docs/engines.md, "llama.cpp").  That closure, recognised by its qualified
name, free variables and the names its code reads, is replaced by an
equivalent that keeps one strided float32 view of the ``logit`` field
while the array's address and size repeat, calls each processor as stock
does, and skips writing back a result that *is* that view (stock's
self-assignment changes nothing).

Only while the cache is active and every processor is an outlines one;
anything else runs llama-cpp-python's own code, and an ``apply_func`` of
an unknown shape runs stock with one warning.
"""

from __future__ import annotations

import ctypes
import functools
from types import ModuleType
from typing import Any, Callable

import numpy as np
from packaging.version import Version

from outlines_maskcache.contract import Patch, UnknownLayout
from outlines_maskcache.gate import when_active
from outlines_maskcache.runtime import RUNTIME

#: ``Llama._init_sampler``'s closure, as llama-cpp-python 0.3.x writes it
QUALNAME = "Llama._init_sampler.<locals>.apply_func"
FREEVARS = ("logits_processor", "self")
#: names its code must read: the recarray over ``llama_token_data`` and the processors' inputs
READS = frozenset({"recarray", "logit", "_input_ids", "llama_token_data", "from_address"})
#: the record stock builds over each candidate (id, logit, p)
STOCK_DTYPE = np.dtype([("id", np.intc), ("logit", np.single), ("p", np.single)], align=True)


def _is_stock_apply(func: Any) -> bool:
    code = getattr(func, "__code__", None)
    return (code is not None and getattr(func, "__qualname__", None) == QUALNAME
            and code.co_freevars == FREEVARS and READS <= set(code.co_names))


@functools.lru_cache(maxsize=None)
def _outlines_processor_type() -> type | None:
    """outlines' processor base class, looked up when a hook is first made (outlines may be imported after us)."""
    try:
        from outlines.processors.base_logits_processor import OutlinesLogitsProcessor
    except Exception:  # noqa: BLE001 - without outlines nothing is ours to speed up
        return None
    return OutlinesLogitsProcessor


def patches(module: ModuleType, version: Version) -> list[Patch]:
    import llama_cpp

    sampler_cls = module.LlamaSampler
    stock_add = sampler_cls.__dict__["add_custom"]
    record = llama_cpp.llama_token_data
    # The view below must address exactly the bytes stock's recarray does.
    stride, offset = ctypes.sizeof(record), record.logit.offset
    if (stride, offset) != (STOCK_DTYPE.itemsize, STOCK_DTYPE.fields["logit"][1]) or record.logit.size != 4:
        raise UnknownLayout(f"llama_token_data layout {stride=} {offset=} differs from the record stock views")

    def faster(stock_apply: Callable[[Any], None], ours: type) -> Callable[[Any], None]:
        cells = dict(zip(stock_apply.__code__.co_freevars, stock_apply.__closure__))
        processors_cell, llama_cell = cells["logits_processor"], cells["self"]
        seen: list[Any] = [None, None]  # (address, size), the float32 view over that memory

        def apply_func(token_data_array: Any) -> None:
            processors = processors_cell.cell_contents
            if not RUNTIME.active() or not all(isinstance(p, ours) for p in processors):
                return stock_apply(token_data_array)
            try:
                candidates = token_data_array.contents
                size = candidates.size
                where = (ctypes.cast(candidates.data, ctypes.c_void_p).value, size)
                if seen[0] != where:
                    raw = (ctypes.c_char * (size * stride)).from_address(where[0])
                    seen[1] = np.ndarray((size,), np.float32, raw, offset, (stride,))
                    seen[0] = where
                logits = seen[1]
            except Exception as err:  # noqa: BLE001 - nothing ran yet: stock's hook does it all
                RUNTIME.fault("llama.cpp sampler hook", err)
                return stock_apply(token_data_array)
            input_ids = llama_cell.cell_contents._input_ids
            for processor in processors:
                result = processor(input_ids, logits)
                if result is not logits:
                    logits[:] = result

        apply_func.__wrapped__ = stock_apply  # type: ignore[attr-defined]
        return apply_func

    @when_active(stock_add)
    def add_custom(self: Any, apply_func: Callable[[Any], None]) -> Any:
        # Anything but llama's own closure passes straight through, before any lookup.
        ours = _outlines_processor_type() if getattr(apply_func, "__qualname__", None) == QUALNAME else None
        if ours is not None:
            if _is_stock_apply(apply_func):
                RUNTIME.cache.count("sampler_hooks")
                apply_func = faster(apply_func, ours)
            else:
                RUNTIME.fault("llama.cpp sampler hook", TypeError(
                    f"{QUALNAME} has a shape this version does not know; llama-cpp-python's own hook runs"))
        return stock_add(self, apply_func)

    return [Patch(sampler_cls, "add_custom", add_custom)]
