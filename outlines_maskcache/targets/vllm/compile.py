"""vLLM compiles: the content name of a compiled grammar, the quiet guide, and the Index through the store.

* ``OutlinesBackend.compile_grammar``: stock compiles (vLLM keeps the Index
  in its own LRU keyed by vocabulary hash + regex); the returned grammar is
  tagged with a *content* fingerprint of what was compiled (vocabulary,
  vocab size, request type, spec), so every request with the same spec
  shares one set of rows, and its guide becomes a
  :class:`~outlines_maskcache.targets.vllm.quiet_guide.QuietGuide`.
* ``OutlinesBackend._compile_index``: through the one compile path
  (:func:`outlines_maskcache.compiled.memoized` and the store), with
  content keys (the tokenizer's vocabulary, the vLLM version, the regex),
  so a restarted server loads Indexes instead of compiling them; a
  never-seen regex gets a lazy Index (:mod:`outlines_maskcache.lazy_compile`)
  while stock compiles (with its timeout) behind it.
* the module's ``oc`` (outlines_core, which vLLM loads lazily): the same
  module, but its ``Guide`` also takes a lazy Index.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

from outlines_maskcache import compiled, lazy_compile
from outlines_maskcache import outlines_core_calls as core
from outlines_maskcache.contract import Patch
from outlines_maskcache.fingerprint import LOCAL_PREFIX, digest
from outlines_maskcache.gate import when_active
from outlines_maskcache.lazy_index import LazyGuide
from outlines_maskcache.runtime import RUNTIME
from outlines_maskcache.targets.vllm.quiet_guide import QuietGuide

TARGET = "vllm-v1"
#: instance attribute carrying a compiled grammar's fingerprint
FINGERPRINT = "_outlines_maskcache_fingerprint"


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
    if core.is_vocabulary_key(vocab_key):
        return digest(TARGET, vocab_key, int(backend.vocab_size), kind, grammar_spec)
    local = getattr(vocabulary, "_hash", None) or RUNTIME.fingerprint(vocabulary)
    return LOCAL_PREFIX + digest(TARGET, local, int(backend.vocab_size), kind, grammar_spec)


def vocabulary_key(backend: Any, vocabulary: Any, vllm_version: str) -> str:
    """A content key for vLLM's outlines vocabulary, computed once per vocabulary object.

    From the tokenizer it was reduced from (vLLM's ``_hash`` hashes a repr
    whose order changes between processes) and the vLLM version, whose
    ``_reduced_vocabulary`` decides the conversion.
    """
    inner = getattr(vocabulary, "inner", vocabulary)
    known = RUNTIME.grammars.get(inner)
    if core.is_vocabulary_key(known):
        return known
    tokenizer = backend.tokenizer
    eos_id = tokenizer.eos_token_id
    eos = tokenizer.convert_ids_to_tokens(eos_id) if eos_id is not None else None
    key = core.vocabulary_key(tokenizer.get_vocab(), eos_id, eos, lambda t: tokenizer.convert_tokens_to_string([t]),
                              "vllm", vllm_version, int(backend.vocab_size))
    RUNTIME.grammars.register(inner, key)
    return key


class GuideTakingLazyIndexes:
    """vLLM's ``oc`` (outlines_core behind vLLM's ``LazyLoader``), whose ``Guide`` also takes a lazy Index.

    vLLM builds each grammar's guide with ``oc.Guide(index, ...)`` inside
    ``compile_grammar``; a stand-in for that one name keeps every other line
    of vLLM's stock.
    """

    def __init__(self, stock: ModuleType) -> None:
        self._stock = stock
        self._guide: Any = None

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._stock, name)
        if name != "Guide":
            return value
        if self._guide is None or self._guide.__wrapped__ is not value:
            self._guide = lazy_compile.guide_factory(value)
            self._guide.__wrapped__ = value
        return self._guide


def patches(module: Any, backend_cls: type, vllm_version: str) -> list[Patch]:
    stock_compile = backend_cls.__dict__["compile_grammar"]
    stock_index = backend_cls.__dict__.get("_compile_index")

    @when_active(stock_compile)
    def compile_grammar(self: Any, request_type: Any, grammar_spec: str, *args: Any, **kwargs: Any) -> Any:
        grammar = stock_compile(self, request_type, grammar_spec, *args, **kwargs)
        try:
            fingerprint = grammar_fingerprint(self, request_type, grammar_spec)
            setattr(grammar, FINGERPRINT, fingerprint)
            guide = grammar.guide
            if isinstance(guide, LazyGuide):
                lazy_compile.rows_named(guide.index, fingerprint)
            if RUNTIME.settings.quiet_advance and (type(guide).__name__ == "Guide" or isinstance(guide, LazyGuide)):
                grammar.guide = QuietGuide(guide)
                RUNTIME.cache.count("quiet_guides")
        except Exception as err:  # noqa: BLE001 - an untagged grammar is simply filled by stock
            RUNTIME.fault("vllm-v1 compile_grammar", err)
        return grammar

    found = [Patch(backend_cls, "compile_grammar", compile_grammar)]
    if stock_index is None:  # the store and the lazy Index depend on it
        return found

    def compile_index(self: Any, regex_string: str, vocabulary: Any) -> Any:
        stock: Callable[[], Any] = lambda: stock_index(self, regex_string, vocabulary)  # noqa: E731
        content = RUNTIME.store() is not None
        if not RUNTIME.active() or not (content or lazy_compile.enabled()[0]):
            return stock()

        def key() -> tuple:  # the vocabulary's key is computed once, then read from the registry
            vocab = vocabulary_key(self, vocabulary, vllm_version) if content else RUNTIME.fingerprint(vocabulary)
            return ("vllm-index", vocab, regex_string)

        def build(memo_key: tuple) -> Any:
            full = (lambda: compiled.stored("index", memo_key[1:], stock, core.load_index)) if content else stock
            return lazy_compile.index_for(regex_string, vocabulary.inner, memo_key[1] if content else None, memo_key,
                                          full)

        return compiled.memoized("vllm-v1 vocabulary key", key, build, stock, content=content)

    found.append(Patch(backend_cls, "_compile_index", compile_index))
    if "oc" in vars(module):
        # vLLM's LazyLoader puts the real module in its place on first use, which would drop a stand-in
        # set over the loader: load it now (vLLM's first compile would), and stand in for the module.
        getattr(vars(module)["oc"], "Guide")
        found.append(Patch(module, "oc", GuideTakingLazyIndexes(vars(module)["oc"])))
    return found
