"""Compiled outlines_core grammars through the persistent store.

The one place that knows both sides: outlines_core objects (``Index``,
``Vocabulary``, serialised with their own ``from_binary`` format) and the
store (verified bytes by key).  Adapters say *what* a compiled object depends
on; this module names it, loads it or builds and saves it.

A key is a digest of everything the bytes depend on: this layout, the
outlines_core version (its binary format and its compiler), the kind of
object and the adapter's parts (for an Index: the vocabulary's content key
and the regex).  outlines_core's bytes are not themselves deterministic (its
hash maps are seeded per process), so keys are never derived from them.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
from array import array
from operator import itemgetter
from typing import Any, Callable, TypeVar

from outlines_maskcache.fingerprint import digest
from outlines_maskcache.guard import binary_of
from outlines_maskcache.runtime import RUNTIME

T = TypeVar("T")

#: registry fingerprints of vocabularies named by their content: only an
#: Index over such a vocabulary can be named, hence stored
VOCABULARY_PREFIX = "vocab:"
#: bump when what a key covers changes
KEY_LAYOUT = 1
#: tokens whose converted strings enter a vocabulary's key: they pin the
#: tokenizer's decoding rules (byte-level, SentencePiece...) beside its table
_PROBES = 97


@functools.lru_cache(maxsize=None)
def outlines_core_version() -> str:
    try:
        return importlib.metadata.version("outlines_core")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - vendored builds
        import outlines_core

        return str(getattr(outlines_core, "__version__", "unknown"))


def store_key(kind: str, *parts: object) -> str:
    """The store key of a compiled object: 64 hex digits over all it depends on."""
    h = hashlib.sha256()
    for part in ("outlines_maskcache", KEY_LAYOUT, outlines_core_version(), kind, *parts):
        data = part if isinstance(part, bytes) else repr(part).encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def vocabulary_key(vocab: dict[str, int], eos_token_id: Any, eos_token: Any,
                   token_to_str: Callable[[str], str], *extra: object) -> str:
    """A content key for a tokenizer vocabulary as a converter sees it (~40 ms at 128k tokens).

    It covers every (token, id) pair, the EOS token and id, and the
    converted strings of a spread of tokens, so two tokenizers with one table
    but different decoding rules get different keys.
    """
    by_id = dict(zip(vocab.values(), vocab.keys()))
    if len(by_id) == len(vocab):  # ids are unique: order by id with an integer sort
        ids = sorted(by_id)
        tokens = [by_id[i] for i in ids]
    else:
        items = sorted(vocab.items(), key=itemgetter(1, 0))
        tokens, ids = [t for t, _ in items], [i for _, i in items]
    h = hashlib.sha256()
    h.update("\x00".join(tokens).encode("utf-8", "surrogatepass"))
    h.update(array("q", ids).tobytes())
    step = max(1, len(tokens) // _PROBES)
    probes = [token_to_str(token) for token in tokens[::step]]
    return digest("vocabulary", h.hexdigest(), eos_token_id, eos_token, token_to_str(eos_token) if eos_token else None,
                  probes, *extra)


def stored(kind: str, parts: tuple, build: Callable[[], T], load: Callable[[bytes], T]) -> T:
    """The object named by (*kind*, *parts*): loaded from the store, or built and saved there.

    A stored entry that passes the store's checksum but that *load* rejects
    (a foreign format) is deleted and rebuilt, exactly like a corrupt file.
    Store trouble of any kind costs a compile, never a wrong or failed result.
    """
    store = RUNTIME.store()
    if store is None:
        return build()
    key = store_key(kind, *parts)
    data = store.get(key)
    if data is not None:
        try:
            return load(data)
        except Exception as err:  # noqa: BLE001 - an unreadable entry is a miss
            store.discard(key, f"{kind} entry does not load ({type(err).__name__}: {err})")
    value = build()
    try:
        store.put(key, binary_of(value))
    except Exception as err:  # noqa: BLE001 - failing to save never fails the caller
        RUNTIME.fault(f"store write {kind}", err)
    return value


def _guarded(settings: Any) -> bool:
    """Whether the opt-in compile guard is on (either limit set)."""
    return settings.compile_timeout is not None or settings.compile_max_bytes is not None


def compile_index(regex: str, vocabulary: Any, vocab_key: str | None) -> Any:
    """``Index(regex, vocabulary)`` via the store (when *vocab_key* names its content) and the compile guard."""
    from outlines_core import Index

    def build() -> Any:
        settings = RUNTIME.settings
        if not _guarded(settings):
            return Index(regex, vocabulary)
        from outlines_maskcache.guard import compile_index as guarded

        # An unnamed vocabulary goes by its registry token, never by id(): a
        # worker keeps what it was sent, and ids are recycled.
        return guarded(regex, vocabulary, vocab_key or RUNTIME.fingerprint(vocabulary),
                       settings.compile_timeout, settings.compile_max_bytes)

    if vocab_key is None:
        return build()
    return stored("index", (vocab_key, regex), build, Index.from_binary)


def schema_regex(schema: str, whitespace_pattern: str | None, stock: Callable[..., str]) -> str:
    """*stock*'s regex for a JSON schema, built in the compile guard's worker when that guard is on.

    With the guard on, the conversion needs it as much as the compile: for
    some real schemas outlines_core's conversion alone asks for gigabytes.
    The worker runs ``outlines_core.json_schema.build_regex_from_schema``,
    which callers check *stock* is.
    """
    settings = RUNTIME.settings
    if not _guarded(settings):
        return stock(schema, whitespace_pattern)
    from outlines_maskcache.guard import regex_from_schema

    return regex_from_schema(schema, whitespace_pattern, settings.compile_timeout, settings.compile_max_bytes)


def load_vocabulary(data: bytes) -> Any:
    from outlines_core import Vocabulary

    return Vocabulary.from_binary(data)
