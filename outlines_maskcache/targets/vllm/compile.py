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
  so a restarted server loads Indexes instead of compiling them; stock
  compiles (with its timeout) on a miss.
"""

from __future__ import annotations

from typing import Any, Callable

from outlines_maskcache import compiled
from outlines_maskcache import outlines_core_calls as core
from outlines_maskcache.contract import Patch
from outlines_maskcache.fingerprint import LOCAL_PREFIX, digest
from outlines_maskcache.gate import when_active
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


def patches(backend_cls: type, vllm_version: str) -> list[Patch]:
    stock_compile = backend_cls.__dict__["compile_grammar"]
    stock_index = backend_cls.__dict__.get("_compile_index")

    @when_active(stock_compile)
    def compile_grammar(self: Any, request_type: Any, grammar_spec: str, *args: Any, **kwargs: Any) -> Any:
        grammar = stock_compile(self, request_type, grammar_spec, *args, **kwargs)
        try:
            setattr(grammar, FINGERPRINT, grammar_fingerprint(self, request_type, grammar_spec))
            if RUNTIME.settings.quiet_advance and type(grammar.guide).__name__ == "Guide":
                grammar.guide = QuietGuide(grammar.guide)
                RUNTIME.cache.count("quiet_guides")
        except Exception as err:  # noqa: BLE001 - an untagged grammar is simply filled by stock
            RUNTIME.fault("vllm-v1 compile_grammar", err)
        return grammar

    found = [Patch(backend_cls, "compile_grammar", compile_grammar)]
    if stock_index is None:  # only the store depends on it
        return found

    def compile_index(self: Any, regex_string: str, vocabulary: Any) -> Any:
        stock: Callable[[], Any] = lambda: stock_index(self, regex_string, vocabulary)  # noqa: E731
        if not RUNTIME.active() or RUNTIME.store() is None:
            return stock()
        def key() -> tuple:  # the vocabulary's key is computed once, then read from the registry
            return ("vllm-index", vocabulary_key(self, vocabulary, vllm_version), regex_string)

        return compiled.memoized(
            "vllm-v1 vocabulary key", key,
            lambda: compiled.stored("index", key()[1:], stock, core.load_index),
            stock, content=True,
        )

    found.append(Patch(backend_cls, "_compile_index", compile_index))
    return found
