"""Adapter for vLLM V1 (>= 0.11): ``vllm.v1.structured_output.backend_outlines``.

vLLM's outlines backend fills one int32 bitmask row per constrained request
per step with ``guide.write_mask_into``, in the EngineCore process, from a
thread pool for large batches.  That costs ~130 us at 50k and ~350 us at 128k
vocabulary for a dense state (free text inside a JSON string; measured here),
~5 us for a sparse one.  The row depends only on the compiled Index and the
guide's state, so it is cached (a hit costs ~6 us, mostly Python glue):

* ``OutlinesBackend.compile_grammar``: stock compiles (vLLM already keeps
  the Index in its own LRU keyed by vocabulary hash + regex, so nothing is
  memoized here); the returned grammar is tagged with a *content*
  fingerprint of what was compiled (vocabulary hash, vocab size, request
  type, spec), so every request with the same spec shares one set of rows.
* ``OutlinesGrammar.fill_bitmask``: a hit copies the cached row into
  ``bitmask[idx]`` through a numpy view; a miss runs stock's
  ``write_mask_into`` into a fresh row and caches it.  Any fault runs stock's ``fill_bitmask``, which
  overwrites the whole row, so a half-done copy can never leak out.
* ``OutlinesBackend.destroy``: writes the stats file (below), then stock.
* The guide of every grammar compiled while active is a
  :class:`~outlines_maskcache.quiet_guide.QuietGuide`: vLLM's
  ``accept_tokens`` / ``_is_finished_after`` call ``guide.advance(t)`` and
  drop the list of allowed tokens outlines_core builds for the new state
  (~0.6 ms at 128k vocabulary, most of vLLM's structured-output time); the
  quiet guide skips building a list its caller discards, and nothing else.
  ``OUTLINES_MASKCACHE_QUIET_ADVANCE=0`` turns this off.
* ``vllm.v1.structured_output.utils.xgr`` (the ``xgrammar`` module vLLM
  applies every step's bitmask with): a stand-in whose
  ``apply_token_bitmask_inplace`` hands CPU rows to
  :class:`~outlines_maskcache.bitmask_plans.BitmaskApplier`: a row that
  allows few tokens by keep-fill-restore (~40 us instead of xgrammar's
  ~500 us for a 1,000-of-128k row), a row that blocks few (inside a JSON
  string) by one ``index_fill_`` down the columns of the whole batch on
  torch's threads, the other rows put right after (~15 us a row at 128k
  and B = 32 instead of ~40 us on xgrammar's one thread).  The fill
  tells it which cached rows it served (a hint, verified word for word
  against the bitmask); every other row, and every GPU tensor, goes to
  xgrammar, with the kernel's exact semantics.
  ``OUTLINES_MASKCACHE_SPARSE_APPLY=0`` turns the stand-in off,
  ``OUTLINES_MASKCACHE_DENSE_APPLY=0`` only its dense rows.
* ``OutlinesBackend._compile_index``: through the persistent grammar store
  and an in-memory memo (content keys: the tokenizer's vocabulary, the vLLM
  version, the regex), so a restarted server loads Indexes instead of
  compiling them; stock compiles (with its timeout) on a miss.

A grammar compiled while the cache was off (or by code we do not know)
carries no fingerprint and is always filled by stock.

vLLM loads this module through the ``vllm.general_plugins`` entry point in
every process it starts (:func:`plugin`).  The EngineCore usually runs in its
own process, where ``outlines_maskcache.stats()`` of the caller cannot see;
set ``OUTLINES_MASKCACHE_STATS_FILE=/path/stats-{pid}.json`` to have each
process that filled bitmasks write its stats there when vLLM destroys the
backend (the first step of EngineCore shutdown, after the last fill: exit
hooks are no use there, as vLLM force-kills an EngineCore that takes more
than a few seconds to stop) and again at interpreter exit.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Any

import numpy as np

from outlines_maskcache import compiled, stats_file
from outlines_maskcache.bitmask_plans import BitmaskApplier
from outlines_maskcache.config import FALSE_WORDS
from outlines_maskcache.fingerprint import LOCAL_PREFIX, digest
from outlines_maskcache.masking import bitmask_row, cached_or_stock
from outlines_maskcache.patching import Patch
from outlines_maskcache.quiet_guide import QuietGuide
from outlines_maskcache.runtime import RUNTIME

TARGET = "vllm-v1"
ENV_QUIET_ADVANCE = "OUTLINES_MASKCACHE_QUIET_ADVANCE"
ENV_SPARSE_APPLY = "OUTLINES_MASKCACHE_SPARSE_APPLY"
ENV_DENSE_APPLY = "OUTLINES_MASKCACHE_DENSE_APPLY"
#: plans for the bitmask rows this process applies (one engine per process)
APPLIER = BitmaskApplier()
#: instance attribute carrying a compiled grammar's fingerprint
_FINGERPRINT = "_outlines_maskcache_fingerprint"


def grammar_fingerprint(backend: Any, request_type: Any, grammar_spec: str) -> str:
    """A content name for what ``compile_grammar(request_type, grammar_spec)`` compiled.

    The Index is a deterministic function of (regex, vocabulary), and the
    regex of (request type, spec), so equal names mean equal masks per state
    across requests and across vLLM's own Index-cache evictions.
    """
    vocabulary = backend.vocabulary
    kind = getattr(request_type, "name", str(request_type))
    # The content key when the store named the vocabulary: stable across
    # processes, so rows persist.  Else vLLM's own hash, stable within one.
    vocab_key = RUNTIME.grammars.get(getattr(vocabulary, "inner", vocabulary))
    if vocab_key is not None and vocab_key.startswith(compiled.VOCABULARY_PREFIX):
        return digest(TARGET, vocab_key, int(backend.vocab_size), kind, grammar_spec)
    local = getattr(vocabulary, "_hash", None) or RUNTIME.fingerprint(vocabulary)
    return LOCAL_PREFIX + digest(TARGET, local, int(backend.vocab_size), kind, grammar_spec)


def patches(module: ModuleType) -> list[Patch]:
    backend_cls = module.OutlinesBackend
    grammar_cls = module.OutlinesGrammar
    stock_compile = backend_cls.__dict__["compile_grammar"]
    stock_fill = grammar_cls.__dict__["fill_bitmask"]
    stock_destroy = getattr(backend_cls, "destroy", None)
    stock_index = backend_cls.__dict__.get("_compile_index")

    def compile_grammar(self: Any, request_type: Any, grammar_spec: str, *args: Any, **kwargs: Any) -> Any:
        grammar = stock_compile(self, request_type, grammar_spec, *args, **kwargs)
        if RUNTIME.active():
            try:
                setattr(grammar, _FINGERPRINT, grammar_fingerprint(self, request_type, grammar_spec))
                if _switched_on(ENV_QUIET_ADVANCE) and type(grammar.guide).__name__ == "Guide":
                    grammar.guide = QuietGuide(grammar.guide)
                    RUNTIME.cache.count("quiet_guides")
            except Exception as err:  # noqa: BLE001 - an untagged grammar is simply filled by stock
                RUNTIME.fault("vllm-v1 compile_grammar", err)
        return grammar

    def _compile_index(self: Any, regex_string: str, vocabulary: Any) -> Any:
        assert stock_index is not None
        if not RUNTIME.active() or RUNTIME.store() is None:
            return stock_index(self, regex_string, vocabulary)
        try:
            vocab_key = _vocabulary_key(self, vocabulary)
        except Exception as err:  # noqa: BLE001 - unnamed vocabularies compile stock
            RUNTIME.fault("vllm-v1 vocabulary key", err)
            return stock_index(self, regex_string, vocabulary)
        from outlines_core import Index

        return RUNTIME.grammar_memo.get_or_build(
            ("vllm-index", vocab_key, regex_string),
            lambda: compiled.stored("index", (vocab_key, regex_string),
                                    lambda: stock_index(self, regex_string, vocabulary), Index.from_binary),
        )

    def fill_bitmask(self: Any, bitmask: Any, idx: int) -> None:
        fingerprint = getattr(self, _FINGERPRINT, None)
        if fingerprint is None or not RUNTIME.active():
            return stock_fill(self, bitmask, idx)
        view = _cpu_view(bitmask)
        if view is None:
            return stock_fill(self, bitmask, idx)
        stats_file.filled()

        def cached() -> None:
            row = bitmask_row(fingerprint, self.guide, view.shape[1])
            view[idx] = row
            FILLED_ROWS.filled(row)

        cached_or_stock("vllm-v1 fill_bitmask", cached, lambda: stock_fill(self, bitmask, idx))

    def destroy(self: Any) -> Any:
        stats_file.write_safely()
        return stock_destroy(self)

    found = [
        Patch(backend_cls, "compile_grammar", compile_grammar),
        Patch(grammar_cls, "fill_bitmask", fill_bitmask),
    ]
    if stock_destroy is not None:  # only the stats file depends on it
        found.append(Patch(backend_cls, "destroy", destroy))
    if stock_index is not None:  # only the store depends on it
        found.append(Patch(backend_cls, "_compile_index", _compile_index))
    utils = sys.modules.get(module.__name__.rpartition(".")[0] + ".utils")
    if utils is not None and "xgr" in vars(utils):  # only the sparse apply depends on it
        found.append(Patch(utils, "xgr", XgrammarStandIn(vars(utils)["xgr"])))
    return found


class XgrammarStandIn:
    """The ``xgrammar`` module as vLLM's ``apply_grammar_bitmask`` sees it: sparse CPU rows planned.

    Everything but ``apply_token_bitmask_inplace`` is the module's own.  vLLM
    holds xgrammar behind a ``LazyLoader`` that, on first use, overwrites the
    global it sits in with the real module, which would silently drop this
    stand-in; so the module is imported here by name instead, and the loader
    object is what ``uninstall`` puts back.
    """

    def __init__(self, original: Any) -> None:
        self.original = original
        self._name = getattr(original, "__name__", "xgrammar")
        self._module: Any = None

    @property
    def _inner(self) -> Any:
        module = self._module
        if module is None:
            import importlib

            module = self._module = importlib.import_module(self._name)
        return module

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    def apply_token_bitmask_inplace(self, logits: Any, bitmask: Any, *args: Any, **kwargs: Any) -> None:
        stock = self._inner.apply_token_bitmask_inplace
        # vocab_size goes to xgrammar: its CPU kernel masks whole words past
        # one that is not a multiple of 32, unlike its documentation (vLLM passes none).
        if args or not kwargs.keys() <= {"indices"} or not RUNTIME.active():
            return stock(logits, bitmask, *args, **kwargs)
        by_content, served = FILLED_ROWS.take()
        if (not (by_content or served) or not _switched_on(ENV_SPARSE_APPLY)
                or not APPLIER.applies_to(logits, bitmask)):
            return stock(logits, bitmask, *args, **kwargs)
        indices = kwargs.get("indices")
        rows = indices.tolist() if hasattr(indices, "tolist") else indices

        def rest(found: list[int] | None) -> None:
            if found is None:
                stock(logits, bitmask, **kwargs)
            elif found:
                stock(logits, bitmask, indices=found)

        counts = cached_or_stock("vllm-v1 bitmask apply",
                                 lambda: APPLIER.apply(logits, bitmask, rows, None, rest, expected=served,
                                                       by_content=by_content, dense=_switched_on(ENV_DENSE_APPLY)),
                                 lambda: stock(logits, bitmask, *args, **kwargs))
        if counts is None:  # the stock kernel ran
            return None
        RUNTIME.cache.count("sparse_apply_rows", counts.sparse)
        RUNTIME.cache.count("dense_apply_rows", counts.dense)
        RUNTIME.cache.count("kernel_apply_rows", counts.kernel)
        stats_file.filled()  # a worker apart from the EngineCore reports too


class FilledRows:
    """The plannable cached rows the fill served since the last apply: the apply's hint.

    Rows are matched to the bitmask word for word, so a stale hint (a
    reused row id, vLLM scheduling a step ahead, a bitmask someone else
    filled) costs time, never correctness.  A step whose rows are all
    neither sparse nor dense pays nothing: nothing is passed, and xgrammar
    runs as in stock.  A process that applies bitmasks it never filled (a
    worker apart from the scheduler) has no hint and looks for sparse rows
    by content, ~0.1-0.2 ms at B = 32 and 128k.
    """

    def __init__(self) -> None:
        self.seen_fills = False
        #: id -> served row, since the last apply (the references keep the ids unique)
        self._served: dict[int, np.ndarray] = {}
        #: id of a served cached row -> whether it is worth planning (rows live in the cache)
        self._known: dict[int, bool] = {}

    def filled(self, row: np.ndarray) -> None:
        self.seen_fills = True
        key = id(row)
        plannable = self._known.get(key)
        if plannable is None:
            if len(self._known) >= 65_536:
                self._known.clear()
            plannable = self._known[key] = APPLIER.would_plan(row)
        if plannable:
            if len(self._served) >= 4_096:  # fills with no apply here (a worker applies): keep no history
                self._served.clear()
            self._served[key] = row

    def take(self) -> tuple[bool, list[np.ndarray]]:
        """(look for sparse rows by content, the served rows to match) for this apply."""
        served, self._served = self._served, {}
        return not self.seen_fills, list(served.values())


FILLED_ROWS = FilledRows()
if hasattr(os, "register_at_fork"):  # a forked worker has filled nothing yet
    os.register_at_fork(after_in_child=FILLED_ROWS.__init__)


def _switched_on(env: str) -> bool:
    """Read per call, so a benchmark can compare both ways in one process."""
    return os.environ.get(env, "1").strip().lower() not in FALSE_WORDS


def _vocabulary_key(backend: Any, vocabulary: Any) -> str:
    """A content key for vLLM's outlines vocabulary, computed once per vocabulary object.

    From the tokenizer it was reduced from (vLLM's ``_hash`` hashes a repr
    whose order changes between processes) and the vLLM version, whose
    ``_reduced_vocabulary`` decides the conversion.
    """
    inner = getattr(vocabulary, "inner", vocabulary)
    known = RUNTIME.grammars.get(inner)
    if known is not None and known.startswith(compiled.VOCABULARY_PREFIX):
        return known
    tokenizer = backend.tokenizer
    found = _installed_vllm()
    eos_id = tokenizer.eos_token_id
    eos = tokenizer.convert_ids_to_tokens(eos_id) if eos_id is not None else None
    key = compiled.VOCABULARY_PREFIX + compiled.vocabulary_key(
        tokenizer.get_vocab(), eos_id, eos, lambda t: tokenizer.convert_tokens_to_string([t]),
        "vllm", str(found), int(backend.vocab_size),
    )
    RUNTIME.grammars.register(inner, key)
    return key


def _installed_vllm() -> str:
    from outlines_maskcache.targets import TARGETS

    target = next(t for t in TARGETS if t.name == TARGET)
    found = target.installed()
    return f"{found[0]} {found[1]}" if found else "unknown"


#: (bitmask, its data pointer, its shape, numpy view): vLLM allocates one
#: bitmask per engine and fills it every step, so one slot nearly always hits.
_view_slot: tuple[Any, int, Any, np.ndarray] | None = None


def _cpu_view(bitmask: Any) -> np.ndarray | None:
    """A numpy view of vLLM's (CPU, possibly pinned) int32 bitmask, or None to leave it to stock.

    Torch indexing and ``copy_`` cost ~8 us per row, more than a cache hit
    should; a numpy row assignment costs ~1 us.  The view is re-made if the
    tensor was reallocated or reshaped in place.
    """
    global _view_slot
    slot = _view_slot
    if slot is not None and slot[0] is bitmask and slot[1] == bitmask.data_ptr() and slot[2] == bitmask.shape:
        return slot[3]
    import torch

    if bitmask.device.type != "cpu" or bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        return None
    view = bitmask.numpy()
    _view_slot = (bitmask, bitmask.data_ptr(), bitmask.shape, view)
    return view


def plugin() -> None:
    """vLLM's ``vllm.general_plugins`` entry point: patch the outlines backend of this process.

    Fails soft: vLLM must start even when its layout is one we do not know,
    so every problem is a log message and vLLM runs stock.
    """
    stats_file.engine_plugin(TARGET, "vLLM")
