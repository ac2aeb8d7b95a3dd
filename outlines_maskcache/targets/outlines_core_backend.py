"""Adapter for outlines 1.2-1.3: ``outlines.backends.outlines_core``.

Patched:

* ``OutlinesCoreLogitsProcessor.process_logits``: guides advance exactly as
  stock (same ``is_finished()/accepts_tokens`` rule, read from one
  ``input_ids[:, -1].tolist()`` instead of a scalar read per row); masks come
  from the cache; any fault runs stock's ``bias_logits`` for the step.
* ``OutlinesCoreBackend.__init__`` and ``get_regex_logits_processor``:
  memoized, because outlines builds a new backend (``get_vocab()`` + the
  Vocabulary conversion) and a new Index on every ``model(prompt,
  output_type)`` call, which would both cost 0.3-1.2 s and leave the mask
  cache cold.

Guide state stays in stock's attributes (``_guides``, ``is_first_token``),
so switching ``disabled()`` on or off mid-generation is consistent.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

import numpy as np

from outlines_maskcache.fingerprint import digest
from outlines_maskcache.kernels import allowed_from_words
from outlines_maskcache.masking import cached_or_stock, mask_logits
from outlines_maskcache.patching import Patch
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


def _allowed_writer(guides: list[Any], width: int) -> Callable[[int], np.ndarray]:
    def allowed_of(i: int) -> np.ndarray:
        # The same call stock makes, into a buffer shaped as stock allocates it.
        words = np.full((width + 31) // 32, -1, dtype=np.int32)
        guides[i].write_mask_into(words.ctypes.data, words.size, words.itemsize)
        return allowed_from_words(words, width)

    return allowed_of


def patches(module: ModuleType) -> list[Patch]:
    processor_cls = module.OutlinesCoreLogitsProcessor
    backend_cls = module.OutlinesCoreBackend
    index_cls = module.Index
    stock_process = processor_cls.__dict__["process_logits"]
    stock_init = backend_cls.__dict__["__init__"]
    stock_regex = backend_cls.__dict__["get_regex_logits_processor"]

    def process_logits(self: Any, input_ids: Any, logits: Any) -> Any:
        if not RUNTIME.active():
            return stock_process(self, input_ids, logits)
        adapter = self.tensor_adapter
        batch_size = adapter.shape(input_ids)[0]
        vocab_size = adapter.shape(logits)[1]
        if self.is_first_token:
            self._setup(batch_size, vocab_size)
            self.is_first_token = False
        else:
            last_tokens = input_ids[:, -1].tolist()
            guides = self._guides
            for i in range(batch_size):
                token = last_tokens[i]
                guide = guides[i]
                # Stock's workaround for outlines_core#227, kept verbatim.
                if not guide.is_finished() or guide.accepts_tokens([token]):
                    guide.advance(token_id=token, return_tokens=False)

        def cached() -> Any:
            guides = self._guides[:batch_size]
            if len(guides) != batch_size:
                raise IndexError("batch grew since the first step")
            states = [g.get_state() for g in guides]
            return mask_logits(self.index, states, logits, _allowed_writer(guides, vocab_size))

        return cached_or_stock("outlines_core mask", cached, lambda: self.bias_logits(batch_size, logits))

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
            RUNTIME.grammars.register(probe.vocabulary, digest(*key))
            return dict(probe.__dict__)

        self.__dict__.update(RUNTIME.vocabulary_memo.get_or_build(key, build))

    def get_regex_logits_processor(self: Any, regex: str) -> Any:
        if not RUNTIME.active():
            return stock_regex(self, regex)
        vocabulary = self.vocabulary
        key = ("index", RUNTIME.fingerprint(vocabulary), regex)

        def build() -> Any:
            index = index_cls(regex, vocabulary)
            RUNTIME.grammars.register(index, digest(*key))
            return index

        index = RUNTIME.grammar_memo.get_or_build(key, build)
        return module.OutlinesCoreLogitsProcessor(index, self.tensor_library_name)

    return [
        Patch(processor_cls, "process_logits", process_logits),
        Patch(backend_cls, "__init__", __init__),
        Patch(backend_cls, "get_regex_logits_processor", get_regex_logits_processor),
    ]
