"""Adapter for outlines 1.2-1.3: ``outlines.backends.outlines_core``.

Patched:

* ``OutlinesCoreLogitsProcessor.process_logits``: guides advance exactly as
  stock (same ``is_finished()/accepts_tokens`` rule, read from one
  ``input_ids[:, -1].tolist()`` instead of a scalar read per row); masks come
  from the cache; any fault runs stock's ``bias_logits`` for the step.
* ``OutlinesCoreBackend.create_outlines_core_vocabulary`` and
  ``get_regex_logits_processor``: memoized, because outlines rebuilds the
  Vocabulary and the Index on every ``model(prompt, output_type)`` call, which
  would both cost 0.3-1.2 s and leave the mask cache cold.

Guide state stays in stock's attributes (``_guides``, ``is_first_token``),
so switching ``disabled()`` on or off mid-generation is consistent.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

import numpy as np

from outlines_maskcache.fingerprint import digest, vocabulary_hash
from outlines_maskcache.kernels import allowed_from_words
from outlines_maskcache.masking import cached_or_stock, mask_logits
from outlines_maskcache.patching import Patch
from outlines_maskcache.runtime import RUNTIME


def callable_identity(fn: Callable[..., Any]) -> tuple[Any, ...]:
    """A key for what *fn* computes, stable across re-creations of the same closure.

    outlines passes ``tokenizer.convert_token_to_string`` (a new bound method
    on every access) or, for mlx-lm, a fresh lambda closing over the
    tokenizer.  Both are named by their code plus the identities of what they
    close over, each held by the grammar registry so ids are not recycled.
    """
    owner = getattr(fn, "__self__", None)
    func = getattr(fn, "__func__", None)
    if owner is not None and func is not None:
        return ("method", RUNTIME.fingerprint(owner), func)
    code = getattr(fn, "__code__", None)
    if code is not None:
        cells = tuple(RUNTIME.fingerprint(c.cell_contents) for c in (fn.__closure__ or ()))
        return ("function", code, cells)
    return ("object", RUNTIME.fingerprint(fn))


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
    stock_vocab = backend_cls.__dict__["create_outlines_core_vocabulary"]
    stock_regex = backend_cls.__dict__["get_regex_logits_processor"]
    build_vocab = stock_vocab.__func__

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

    def create_outlines_core_vocabulary(vocab: dict, eos_token_id: int, eos_token: str, token_to_str: Callable) -> Any:
        if not RUNTIME.active():
            return build_vocab(vocab, eos_token_id, eos_token, token_to_str)
        key = ("vocabulary", callable_identity(token_to_str), eos_token_id, eos_token, len(vocab), vocabulary_hash(vocab))

        def build() -> Any:
            vocabulary = build_vocab(vocab, eos_token_id, eos_token, token_to_str)
            RUNTIME.grammars.register(vocabulary, digest(key))
            return vocabulary

        return RUNTIME.vocabulary_memo.get_or_build(key, build)

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
        Patch(backend_cls, "create_outlines_core_vocabulary", staticmethod(create_outlines_core_vocabulary)),
        Patch(backend_cls, "get_regex_logits_processor", get_regex_logits_processor),
    ]
