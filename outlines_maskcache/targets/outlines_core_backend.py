"""Adapter for outlines 1.2-1.3: ``outlines.backends.outlines_core``.

Patched:

* ``OutlinesCoreLogitsProcessor.process_logits``: guides advance exactly as
  stock (same ``is_finished()/accepts_tokens`` rule, last tokens read for the
  whole batch at once instead of a scalar read per row); masks come
  from the cache through the processor's :class:`~outlines_maskcache.masking.Masker`;
  any fault runs stock's ``bias_logits`` for the step.
* ``OutlinesCoreLogitsProcessor.__call__``: a 2-D batch skips stock's shape
  normalisation (five shape reads and an assert, pure overhead for 2-D
  input) and goes straight to the step above.
* ``OutlinesCoreBackend.__init__`` and ``get_regex_logits_processor``:
  memoized, because outlines builds a new backend (``get_vocab()`` + the
  Vocabulary conversion) and a new Index on every ``model(prompt,
  output_type)`` call, which would both cost 0.3-1.2 s and leave the mask
  cache cold.
* the module's ``build_regex_from_schema`` (outlines_core's, which stock's
  ``get_json_schema_logits_processor`` calls): unchanged unless the compile
  guard is on, when the conversion runs in the guard's worker as well.
* ``OutlinesCoreBackend.create_outlines_core_vocabulary`` and the Index
  compile: through the persistent store (:mod:`outlines_maskcache.compiled`),
  so a new process loads what any process compiled before.  The vocabulary
  is named by its content (stock's own inputs to the conversion), and an
  Index by that name plus the regex.

Guide state stays in stock's attributes (``_guides``, ``is_first_token``),
so switching ``disabled()`` on or off mid-generation is consistent.
"""

from __future__ import annotations

import importlib.metadata
from types import ModuleType
from typing import Any, Callable

import numpy as np

from outlines_maskcache import compiled
from outlines_maskcache.fingerprint import digest
from outlines_maskcache.kernels import allowed_from_words
from outlines_maskcache.masking import cached_or_stock, masker_of
from outlines_maskcache.patching import Patch
from outlines_maskcache.persisted_masks import words_of
from outlines_maskcache.runtime import RUNTIME


def _tokenizer_stamp(tokenizer: Any) -> Any:
    """A cheap stamp that changes when tokens are added to a tokenizer in place.

    Not ``len(hf_tokenizer)``: that walks the whole vocabulary (~110 ms at 128k).
    """
    inner = getattr(tokenizer, "tokenizer", tokenizer)
    base, added = getattr(inner, "vocab_size", None), getattr(inner, "added_tokens_decoder", None)
    if base is not None and added is not None:
        return base, len(added)
    vocabulary = getattr(tokenizer, "vocabulary", None)
    if vocabulary is not None:
        return len(vocabulary)
    try:
        return len(inner)
    except TypeError:
        return None


def _last_tokens(input_ids: Any) -> list[int]:
    """Each row's last token id as Python ints, the values stock reads one ``to_scalar`` at a time.

    A CPU torch tensor is read through its numpy view: torch's own slicing
    costs about half as much as applying the whole mask at B = 1.
    """
    if getattr(input_ids, "is_cpu", False) and not input_ids.requires_grad:
        return input_ids.numpy()[:, -1].tolist()
    return input_ids[:, -1].tolist()


def _allowed_writer(grammar: Any, guides: list[Any], width: int) -> Callable[[int], np.ndarray]:
    def allowed_of(i: int) -> np.ndarray:
        # Only on a miss: stock's call into a buffer shaped as stock allocates
        # it, or the row persisted for this state by an earlier process.
        words = words_of(RUNTIME.fingerprint(grammar), guides[i], (width + 31) // 32)
        return allowed_from_words(words, width)

    return allowed_of


def patches(module: ModuleType) -> list[Patch]:
    processor_cls = module.OutlinesCoreLogitsProcessor
    backend_cls = module.OutlinesCoreBackend
    stock_process = processor_cls.__dict__["process_logits"]
    stock_call = processor_cls.__call__
    stock_init = backend_cls.__dict__["__init__"]
    stock_regex = backend_cls.__dict__["get_regex_logits_processor"]
    stock_vocabulary = backend_cls.__dict__["create_outlines_core_vocabulary"].__func__
    # The conversion is outlines' code: its version is part of the name.
    outlines_version = importlib.metadata.version("outlines")

    def masked(self: Any, input_ids: Any, logits: Any) -> Any:
        """Stock's ``process_logits`` with the mask served from the cache."""
        # tensor_adapter.shape is ``.shape`` for every library outlines supports.
        batch_size = input_ids.shape[0]
        vocab_size = logits.shape[1]
        if self.is_first_token:
            self._setup(batch_size, vocab_size)
            self.is_first_token = False
        else:
            last_tokens = _last_tokens(input_ids)
            guides = self._guides
            for i in range(batch_size):
                token = last_tokens[i]
                guide = guides[i]
                # Stock's workaround for outlines_core#227, kept verbatim.
                if not guide.is_finished() or guide.accepts_tokens([token]):
                    guide.advance(token, False)

        def cached() -> Any:
            guides = self._guides[:batch_size]
            if len(guides) != batch_size:
                raise IndexError("batch grew since the first step")
            states = [g.get_state() for g in guides]
            return masker_of(self, self.index)(states, logits, _allowed_writer(self.index, guides, vocab_size))

        return cached_or_stock("outlines_core mask", cached, lambda: self.bias_logits(batch_size, logits))

    def process_logits(self: Any, input_ids: Any, logits: Any) -> Any:
        if not RUNTIME.active():
            return stock_process(self, input_ids, logits)
        return masked(self, input_ids, logits)

    def __call__(self: Any, input_ids: Any, logits: Any) -> Any:
        # Stock's __call__ normalises its inputs through the tensor adapter
        # (five shape reads, an assert, and for llama.cpp's 1-D call three
        # expand_dims/squeeze: ~20 us a token).  A 2-D batch goes straight to
        # the masked step under the same condition stock asserts, and a 1-D
        # pair (llama.cpp) as the one-row batch stock makes of it, through
        # views of the same memory; anything else, and any subclass that
        # brings its own process_logits, takes stock's way.
        if RUNTIME.active() and type(self).process_logits is process_logits:
            ids_shape = getattr(input_ids, "shape", None)
            shape = getattr(logits, "shape", None)
            if ids_shape is not None and shape is not None:
                if len(shape) == 2 and len(ids_shape) == 2 and shape[0] == ids_shape[0]:
                    return masked(self, input_ids, logits)
                if len(shape) == 1 and len(ids_shape) == 1 and type(logits) is np.ndarray \
                        and type(input_ids) is np.ndarray:
                    rows = logits[None]
                    out = masked(self, input_ids[None], rows)
                    # Masked in place: hand back the caller's own array, which
                    # lets llama.cpp's hook skip its copy-back (llamacpp_sampler).
                    return logits if out is rows else out[0]
        return stock_call(self, input_ids, logits)

    def __init__(self: Any, model: Any) -> None:
        if not RUNTIME.active():
            return stock_init(self, model)
        # What stock derives from the model (vocabulary, eos id, tensor
        # library) depends on its tokenizer only; the key names that
        # tokenizer by identity plus a size stamp, so the 0.1-1 s of
        # get_vocab() + conversion is paid once per tokenizer.
        tokenizer = getattr(model, "mlx_tokenizer", None) or model.tokenizer
        key = ("backend", type(model), RUNTIME.fingerprint(tokenizer), _tokenizer_stamp(tokenizer),
               getattr(tokenizer, "eos_token_id", None), model.tensor_library_name)

        def build() -> dict[str, Any]:
            probe = object.__new__(backend_cls)
            stock_init(probe, model)
            if RUNTIME.grammars.get(probe.vocabulary) is None:  # not named by content below
                RUNTIME.grammars.register(probe.vocabulary, digest(*key))
            return dict(probe.__dict__)

        self.__dict__.update(RUNTIME.vocabulary_memo.get_or_build(key, build))

    def create_outlines_core_vocabulary(vocab: dict, eos_token_id: int, eos_token: str,
                                        token_to_str: Callable[[str], str]) -> Any:
        def build() -> Any:
            return stock_vocabulary(vocab, eos_token_id, eos_token, token_to_str)

        if not RUNTIME.active():
            return build()
        try:
            key = compiled.VOCABULARY_PREFIX + compiled.vocabulary_key(vocab, eos_token_id, eos_token, token_to_str,
                                                                         "outlines", outlines_version)
        except Exception as err:  # noqa: BLE001 - an unusual tokenizer converts stock, unnamed
            RUNTIME.fault("vocabulary key", err)
            return build()
        vocabulary = compiled.stored("vocabulary", (key,), build, compiled.load_vocabulary)
        RUNTIME.grammars.register(vocabulary, key)
        return vocabulary

    def get_regex_logits_processor(self: Any, regex: str) -> Any:
        if not RUNTIME.active():
            return stock_regex(self, regex)
        vocabulary = self.vocabulary
        named = RUNTIME.fingerprint(vocabulary)
        key = ("index", named, regex)

        def build() -> Any:
            content = named if named.startswith(compiled.VOCABULARY_PREFIX) else None
            index = compiled.compile_index(regex, vocabulary, content)
            RUNTIME.grammars.register(index, digest(*key))
            return index

        index = RUNTIME.grammar_memo.get_or_build(key, build)
        return module.OutlinesCoreLogitsProcessor(index, self.tensor_library_name)

    found = [
        Patch(processor_cls, "process_logits", process_logits),
        Patch(processor_cls, "__call__", __call__),
        Patch(backend_cls, "__init__", __init__),
        Patch(backend_cls, "get_regex_logits_processor", get_regex_logits_processor),
        Patch(backend_cls, "create_outlines_core_vocabulary", staticmethod(create_outlines_core_vocabulary)),
    ]
    # The name stock's get_json_schema_logits_processor calls: with the compile
    # guard on, the schema -> regex conversion runs in the guard's worker too.
    # Only when it is outlines_core's own function (what the worker runs).
    from outlines_core.json_schema import build_regex_from_schema as core_schema_regex

    stock_schema_regex = module.__dict__.get("build_regex_from_schema")
    if stock_schema_regex is core_schema_regex:
        def build_regex_from_schema(json_schema: str, whitespace_pattern: str | None = None, *more: Any,
                                    **options: Any) -> str:
            if more or options or not RUNTIME.active():
                return stock_schema_regex(json_schema, whitespace_pattern, *more, **options)
            return compiled.schema_regex(json_schema, whitespace_pattern, stock_schema_regex)

        found.append(Patch(module, "build_regex_from_schema", build_regex_from_schema))
    return found
