"""Adapter for outlines 1.2-1.3: ``outlines.backends.outlines_core``.

Patched, each falling back to stock's own code (docs/engines.md):

* the processor's ``_bias_logits_*`` (the methods stock's ``process_logits``
  dispatches to): masks from the cache, so an override keeps its place;
* ``process_logits`` and ``__call__``: stock's step with the last tokens
  read at once and, for a 2-D batch or llama.cpp's 1-D pair, without the
  tensor adapter's shape normalisation; the advance rule is the installed
  release's (``advance_rule``);
* the backend's ``__init__``, vocabulary conversion and
  ``get_regex_logits_processor``: memoized and stored, because outlines
  rebuilds the Vocabulary and Index on every ``model(prompt, output_type)``
  call; each backend still owns a copy of its vocabulary, and a memoized
  Index is served only while that copy equals its source;
* the module's ``Guide`` name: a lazy Index gets a ``LazyGuide``;
* the schema -> regex conversion, only while the compile guard is on.

Guide state stays in stock's attributes, so ``disabled()`` may switch
mid-generation.
"""

from __future__ import annotations

import copy
import inspect
from types import ModuleType
from typing import Any, Callable

import numpy as np
from packaging.version import Version

from outlines_maskcache import compiled, lazy_compile
from outlines_maskcache import outlines_core_calls as core
from outlines_maskcache.contract import Patch, UnknownLayout
from outlines_maskcache.fingerprint import LOCAL_PREFIX, digest
from outlines_maskcache.gate import cached_or_stock, when_active
from outlines_maskcache.kernels import allowed_from_words
from outlines_maskcache.masker import masker_of
from outlines_maskcache.persisted_masks import words_of
from outlines_maskcache.runtime import RUNTIME

#: from this release a finished guide that accepts the token advances too (outlines_core#227)
ADVANCE_FINISHED_SINCE = Version("1.2.4")
#: from this release the vocabulary conversion keeps every id of tokens that decode alike; before
#: it, the last one in the mapping's iteration order wins, so the order is part of the content
ORDER_FREE_CONVERSION_SINCE = Version("1.3.0")
#: stock's per-library mask methods, which ``_setup`` binds as ``bias_logits``
BIAS_METHODS = ("_bias_logits_torch", "_bias_logits_numpy", "_bias_logits_mlx")
#: instance attribute: (this backend's vocabulary, the memoized one it was copied from)
_VOCABULARY_SOURCE = "_outlines_maskcache_vocabulary"


def _tokenizer_stamp(tokenizer: Any) -> Any:
    """A cheap stamp that changes when tokens are added to a tokenizer in place.

    Not ``len(hf_tokenizer)``: that walks the whole vocabulary.
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
    """Each row's last token id as Python ints, the values stock reads one ``to_scalar`` at a time."""
    if getattr(input_ids, "is_cpu", False) and not input_ids.requires_grad:
        return input_ids.numpy()[:, -1].tolist()
    return input_ids[:, -1].tolist()


def advance_rule(version: Version) -> Callable[[Any, int], bool]:
    """Whether a guide advances on *token*, as the installed release's ``process_logits`` decides."""
    if Version(version.base_version) >= ADVANCE_FINISHED_SINCE:
        return lambda guide, token: not guide.is_finished() or guide.accepts_tokens([token])
    return lambda guide, token: not guide.is_finished()


def _check_layout(module: ModuleType) -> None:
    processor_cls, backend_cls = module.OutlinesCoreLogitsProcessor, module.OutlinesCoreBackend
    missing = [name for name in ("process_logits", "_setup", *BIAS_METHODS) if name not in processor_cls.__dict__]
    missing += [name for name in ("__init__", "get_regex_logits_processor", "create_outlines_core_vocabulary")
                if name not in backend_cls.__dict__]
    if missing:
        raise UnknownLayout(f"outlines' outlines_core backend has no {', '.join(missing)}")
    parameters = list(inspect.signature(backend_cls.create_outlines_core_vocabulary).parameters)
    if parameters[:3] != ["vocab", "eos_token_id", "eos_token"] or parameters[3:] not in ([], ["token_to_str"]):
        raise UnknownLayout(f"create_outlines_core_vocabulary{tuple(parameters)} is not a signature we know")


def patches(module: ModuleType, version: Version) -> list[Patch]:
    _check_layout(module)
    processor_cls = module.OutlinesCoreLogitsProcessor
    return [
        *_processor_patches(processor_cls, advance_rule(version)),
        *_backend_patches(module, str(version)),
        *_schema_patches(module),
    ]


# -- the processor ---------------------------------------------------------------

def _allowed_writer(grammar: Any, guides: list[Any], width: int) -> Callable[[int], np.ndarray]:
    def allowed_of(i: int) -> np.ndarray:
        # Only on a miss: stock's call into a buffer shaped as stock allocates
        # it, or the row persisted for this state by an earlier process.
        words = words_of(RUNTIME.fingerprint(grammar), guides[i], (width + 31) // 32)
        return allowed_from_words(words, width)

    return allowed_of


def cached_bias(stock_bias: Callable[[Any, int, Any], Any]) -> Callable[[Any, int, Any], Any]:
    """A replacement for one of stock's ``_bias_logits_*``: the guides' masks served from the cache."""

    @when_active(stock_bias)
    def bias(self: Any, batch_size: int, logits: Any) -> Any:
        def cached() -> Any:
            guides = self._guides[:batch_size]
            if len(guides) != batch_size:
                raise IndexError("batch grew since the first step")
            states = [g.get_state() for g in guides]
            return masker_of(self, self.index)(states, logits, _allowed_writer(self.index, guides, logits.shape[1]))

        return cached_or_stock("outlines_core mask", cached, lambda: stock_bias(self, batch_size, logits))

    return bias


def _processor_patches(processor_cls: type, advances: Callable[[Any, int], bool]) -> list[Patch]:
    stock_process = processor_cls.__dict__["process_logits"]
    stock_call = processor_cls.__call__

    @when_active(stock_process)
    def process_logits(self: Any, input_ids: Any, logits: Any) -> Any:
        """Stock's ``process_logits``, last tokens read at once, ending in stock's ``bias_logits`` dispatch."""
        batch_size = input_ids.shape[0]
        if self.is_first_token:
            self._setup(batch_size, logits.shape[1])
            self.is_first_token = False
        else:
            last_tokens = _last_tokens(input_ids)
            guides = self._guides
            for i in range(batch_size):
                if advances(guides[i], last_tokens[i]):
                    guides[i].advance(token_id=last_tokens[i], return_tokens=False)
        return self.bias_logits(batch_size, logits)

    @when_active(stock_call)
    def __call__(self: Any, input_ids: Any, logits: Any) -> Any:
        # Stock's __call__ normalises its inputs through the tensor adapter
        # (five shape reads, an assert, and for llama.cpp's 1-D call three
        # expand_dims/squeeze).  A 2-D batch goes straight to the step above
        # under the condition stock asserts, and a 1-D numpy pair (llama.cpp)
        # as the one-row batch stock makes of it, through views of the same
        # memory; anything else, and a subclass with its own process_logits,
        # takes stock's way.
        if type(self).process_logits is process_logits:
            ids_shape = getattr(input_ids, "shape", None)
            shape = getattr(logits, "shape", None)
            if ids_shape is not None and shape is not None:
                if len(shape) == 2 and len(ids_shape) == 2 and shape[0] == ids_shape[0]:
                    return process_logits(self, input_ids, logits)
                if len(shape) == 1 and len(ids_shape) == 1 and type(logits) is np.ndarray \
                        and type(input_ids) is np.ndarray:
                    rows = logits[None]
                    out = process_logits(self, input_ids[None], rows)
                    # Masked in place: hand back the caller's own array, which
                    # lets llama.cpp's hook skip its copy-back (targets/llamacpp.py).
                    return logits if out is rows else out[0]
        return stock_call(self, input_ids, logits)

    found = [Patch(processor_cls, "process_logits", process_logits), Patch(processor_cls, "__call__", __call__)]
    found += [Patch(processor_cls, name, cached_bias(processor_cls.__dict__[name])) for name in BIAS_METHODS]
    return found


# -- the backend -----------------------------------------------------------------

def _uses_outlines_core(module: ModuleType, name: str) -> bool:
    """Whether the module's constructor *name* is outlines_core's (not a test double), so a stored object may stand in for it."""
    return core.is_own(name, getattr(module, name, None))


def _backend_patches(module: ModuleType, outlines_version: str) -> list[Patch]:
    backend_cls = module.OutlinesCoreBackend
    stock_init = backend_cls.__dict__["__init__"]
    stock_regex = backend_cls.__dict__["get_regex_logits_processor"]
    stock_vocabulary = backend_cls.__dict__["create_outlines_core_vocabulary"].__func__
    model_types = tuple(getattr(module, name) for name in ("Transformers", "LlamaCpp", "MLXLM") if hasattr(module, name))

    @when_active(stock_init)
    def __init__(self: Any, model: Any) -> None:
        # What stock derives from the model (vocabulary, eos id, tensor
        # library) depends on its tokenizer only; the key names that
        # tokenizer by identity plus a size stamp, so get_vocab() and the
        # conversion are paid once per tokenizer.  A model stock rejects
        # goes to stock, for stock's error.
        if not isinstance(model, model_types):
            return stock_init(self, model)

        try:
            tokenizer = getattr(model, "mlx_tokenizer", None) or model.tokenizer
            parts = ("backend", type(model), RUNTIME.fingerprint(tokenizer), _tokenizer_stamp(tokenizer),
                     getattr(tokenizer, "eos_token_id", None), model.tensor_library_name)
        except Exception as err:  # noqa: BLE001 - a model we cannot name is set up by stock
            RUNTIME.fault("backend memo key", err)
            return stock_init(self, model)

        def build() -> dict[str, Any]:
            probe = object.__new__(backend_cls)
            stock_init(probe, model)
            if RUNTIME.grammars.get(probe.vocabulary) is None:  # not named by content (store off)
                RUNTIME.grammars.register(probe.vocabulary, LOCAL_PREFIX + digest(*parts))
            return dict(probe.__dict__)

        state = RUNTIME.vocabulary_memo.get_or_build(parts, build)
        if _uses_outlines_core(module, "Vocabulary"):
            lazy_compile.prepare(state["vocabulary"])
        self.__dict__.update(state)
        # Never hand out the shared object: a user may mutate their backend's vocabulary.
        own = copy.deepcopy(state["vocabulary"])
        self.vocabulary = own
        setattr(self, _VOCABULARY_SOURCE, (own, state["vocabulary"]))

    @when_active(stock_vocabulary)
    def create_outlines_core_vocabulary(*args: Any, **kwargs: Any) -> Any:
        if not _uses_outlines_core(module, "Vocabulary"):
            return stock_vocabulary(*args, **kwargs)
        return named_vocabulary(stock_vocabulary, outlines_version, args, kwargs)[0]

    @when_active(stock_regex)
    def get_regex_logits_processor(self: Any, regex: str) -> Any:
        vocabulary = self.vocabulary
        if not _uses_outlines_core(module, "Index"):
            return stock_regex(self, regex)
        # The memoized source of this backend's copy, while the copy still equals it.
        own, source = self.__dict__.get(_VOCABULARY_SOURCE, (None, None))
        if own is vocabulary and source is not None:
            if not own == source:
                return stock_regex(self, regex)
            vocabulary = source
        named = RUNTIME.fingerprint(vocabulary)
        content = named if core.is_vocabulary_key(named) else None
        index = compiled.memoized(
            "index memo key", lambda: ("index", named, regex),
            lambda key: lazy_compile.index_for(regex, vocabulary, content, key,
                                               lambda: compiled.compile_index(regex, vocabulary, content)),
            lambda: stock_regex(self, regex), content=content is not None,
        )
        processor = module.OutlinesCoreLogitsProcessor(index, self.tensor_library_name)
        lazy_compile.follow(processor, index)
        return processor

    return [
        # Not gated on the switch: a processor that holds a lazy Index needs its guides under disabled() too.
        Patch(module, "Guide", lazy_compile.guide_factory(module.Guide)),
        Patch(backend_cls, "__init__", __init__),
        Patch(backend_cls, "get_regex_logits_processor", get_regex_logits_processor),
        Patch(backend_cls, "create_outlines_core_vocabulary", staticmethod(create_outlines_core_vocabulary)),
    ]


def named_vocabulary(convert: Callable[..., Any], outlines_version: str, args: tuple,
                     kwargs: dict[str, Any]) -> tuple[Any, str | None]:
    """(``convert(*args, **kwargs)``, its content key): stock's conversion, through the store when it can be named.

    *convert* is stock's ``create_outlines_core_vocabulary`` (three
    parameters in 1.2.0, ``token_to_str`` from 1.2.1).  Arguments stock
    would reject go to stock, for stock's error; a key that cannot be
    computed is a counted fault and the vocabulary is stock's, unnamed.
    """
    try:
        bound = inspect.signature(convert).bind(*args, **kwargs).arguments
    except TypeError:
        return convert(*args, **kwargs), None
    try:
        ordered = Version(Version(outlines_version).base_version) < ORDER_FREE_CONVERSION_SINCE
        key = core.vocabulary_key(bound["vocab"], bound["eos_token_id"], bound["eos_token"],
                                  bound.get("token_to_str"), "outlines", outlines_version, ordered=ordered)
    except Exception as err:  # noqa: BLE001 - an unusual tokenizer converts stock, unnamed
        RUNTIME.fault("vocabulary key", err)
        return convert(*args, **kwargs), None
    vocabulary = compiled.stored("vocabulary", (key,), lambda: convert(*args, **kwargs), core.load_vocabulary)
    RUNTIME.grammars.register(vocabulary, key)
    return vocabulary, key


def transformers_vocabulary(hf_tokenizer: Any, convert: Callable[..., Any]) -> tuple[Any, str]:
    """(Vocabulary, content key) exactly as the installed outlines' backend converts a Hugging Face tokenizer.

    For ahead-of-time compiles: *convert* is stock's own
    ``create_outlines_core_vocabulary`` (whether or not our patches are
    installed); the result is named and stored as the patched backend
    names it and looks it up.
    """
    import importlib.metadata

    from outlines.models.transformers import TransformerTokenizer

    convert = getattr(convert, "__func__", convert)
    tok = TransformerTokenizer(hf_tokenizer)
    # 1.2.0's backend reads the Hugging Face tokenizer's get_vocab() (its TransformerTokenizer has none)
    vocab = tok.get_vocab() if hasattr(tok, "get_vocab") else hf_tokenizer.get_vocab()
    args: tuple = (vocab, tok.eos_token_id, tok.eos_token)
    if "token_to_str" in inspect.signature(convert).parameters:
        args += (tok.convert_token_to_string,)
    version = str(Version(importlib.metadata.version("outlines")))
    vocabulary, key = named_vocabulary(convert, version, args, {})
    if key is None:
        raise RuntimeError("this tokenizer's vocabulary cannot be named by its content; nothing can be stored for it")
    return vocabulary, key


def _schema_patches(module: ModuleType) -> list[Patch]:
    """The schema -> regex conversion in the guard's worker, where the release's layout lets us reach it."""
    core_schema_regex = core.schema_regex_function()
    stock_schema_regex = module.__dict__.get("build_regex_from_schema")
    if stock_schema_regex is core_schema_regex:  # 1.3: the module imports the function by name
        @when_active(stock_schema_regex)
        def build_regex_from_schema(json_schema: str, whitespace_pattern: str | None = None, *more: Any,
                                    **options: Any) -> str:
            if more or options:
                return stock_schema_regex(json_schema, whitespace_pattern, *more, **options)
            return compiled.schema_regex(json_schema, whitespace_pattern, stock_schema_regex)

        return [Patch(module, "build_regex_from_schema", build_regex_from_schema)]
    backend_cls = module.OutlinesCoreBackend
    stock_json = backend_cls.__dict__.get("get_json_schema_logits_processor")
    core_module = module.__dict__.get("outlines_core")
    if stock_json is None or getattr(getattr(core_module, "json_schema", None), "build_regex_from_schema", None) \
            is not core_schema_regex or list(inspect.signature(stock_json).parameters) != ["self", "json_schema"]:
        return []  # a layout we do not know: the conversion stays stock, unguarded

    @when_active(stock_json)
    def get_json_schema_logits_processor(self: Any, json_schema: str) -> Any:
        # 1.2: stock's two lines, with the conversion guarded (only while the guard is on).
        if not compiled.guarded():
            return stock_json(self, json_schema)
        regex = compiled.schema_regex(json_schema, None, core_schema_regex)
        return self.get_regex_logits_processor(regex)

    return [Patch(backend_cls, "get_json_schema_logits_processor", get_json_schema_logits_processor)]
