"""The one compile path: compiled grammars and vocabularies through the memo, the store and the guard.

Adapters say *what* a compiled object depends on; this module names it,
reuses it from the in-process memo, loads it from the persistent store or
builds it (in the guarded worker when the compile guard is on) and saves
it.  Every adapter goes through :func:`memoized` and :func:`stored`, so the
sequence "name it, fall back to stock if it cannot be named, build once,
register its content name, remember it" is written once.

A store key is a digest of everything the bytes depend on: this layout,
the outlines_core version (its binary format and its compiler), the kind
of object and the adapter's parts (for an Index: the vocabulary's content
key and the regex).  outlines_core's bytes are not themselves
deterministic (its hash maps are seeded per process), so keys are never
derived from them.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, TypeVar

from outlines_maskcache import outlines_core_calls as core
from outlines_maskcache.fingerprint import LOCAL_PREFIX, digest
from outlines_maskcache.runtime import RUNTIME

T = TypeVar("T")

#: bump when what a key covers changes
KEY_LAYOUT = 1


def store_key(kind: str, *parts: object) -> str:
    """The store key of a compiled object: 64 hex digits over all it depends on."""
    return digest("outlines_maskcache", KEY_LAYOUT, core.version(), kind, *parts, length=64)


def memoized(where: str, key: Callable[[], tuple[Hashable, ...]], build: Callable[[tuple[Hashable, ...]], T],
             stock: Callable[[], T], content: bool = False) -> T:
    """``build(key())``, built once per process per key and registered under the key's digest.

    *content*: the key names the same thing in every process (no identity
    token in it), so masks of the value may be persisted under its name;
    otherwise the name is marked local to this process.

    A key that cannot be computed (an unusual tokenizer) is a counted
    fault, and the caller gets *stock*'s value, unmemoized.  Builds of one
    key are serialised (:class:`~outlines_maskcache.fingerprint.Memo`): a
    server that receives one schema from 32 threads at once compiles it once.
    """
    try:
        parts = key()
    except Exception as err:  # noqa: BLE001 - whatever cannot be named is built stock
        RUNTIME.fault(where, err)
        return stock()

    def made() -> T:
        value = build(parts)
        if RUNTIME.grammars.get(value) is None:  # a value the store named keeps its content name
            RUNTIME.grammars.register(value, digest(*parts) if content else LOCAL_PREFIX + digest(*parts))
        return value

    return RUNTIME.grammar_memo.get_or_build(parts, made)


def stored(kind: str, parts: tuple, build: Callable[[], T], load: Callable[[bytes], T],
           dump: Callable[[T], bytes] = core.binary_of) -> T:
    """The object named by (*kind*, *parts*): loaded from the store, or built and saved there.

    *dump* gives the bytes to save (outlines_core's own ``from_binary`` bytes
    unless the object has its own layout).  A stored entry that passes the
    store's checksum but that *load* rejects
    (a foreign format) is deleted and rebuilt, exactly like a corrupt file.
    Store trouble of any kind costs a compile, never a wrong or failed result.
    """
    store = RUNTIME.store()
    if store is None:
        return build()
    found = from_store(kind, parts, load)
    if found is not None:
        return found
    key = store_key(kind, *parts)
    value = build()

    def save() -> None:
        try:
            store.put(key, dump(value))
        except Exception as err:  # noqa: BLE001 - failing to save never fails the caller
            RUNTIME.fault(f"store write {kind}", err)

    # Serialising and writing (tens of MB for a large Index) is not on the path of the first mask.
    RUNTIME.writes.submit(f"store write {kind}", save)
    return value


def from_store(kind: str, parts: tuple, load: Callable[[bytes], T]) -> T | None:
    """The stored object named by (*kind*, *parts*), or None (store off, no entry, or an entry that does not load)."""
    store = RUNTIME.store()
    if store is None:
        return None
    key = store_key(kind, *parts)
    data = store.get(key)
    if data is None:
        return None
    try:
        return load(data)
    except Exception as err:  # noqa: BLE001 - an unreadable entry is a miss
        store.discard(key, f"{kind} entry does not load ({type(err).__name__}: {err})")
        return None


def guarded() -> bool:
    """Whether the opt-in compile guard is on (either limit set)."""
    settings = RUNTIME.settings
    return settings.compile_timeout is not None or settings.compile_max_bytes is not None


def compile_index(regex: str, vocabulary: Any, vocab_key: str | None) -> Any:
    """``Index(regex, vocabulary)`` via the store (when *vocab_key* names its content) and the compile guard."""

    def compile_it() -> Any:
        if not guarded():
            return core.new_index(regex, vocabulary)
        from outlines_maskcache.guard import compile_index as in_worker

        settings = RUNTIME.settings
        # An unnamed vocabulary goes by its registry token, never by id(): a
        # worker keeps what it was sent, and ids are recycled.
        return in_worker(regex, vocabulary, vocab_key or RUNTIME.fingerprint(vocabulary),
                         settings.compile_timeout, settings.compile_max_bytes)

    if vocab_key is None:
        return compile_it()
    return stored("index", (vocab_key, regex), compile_it, core.load_index)


def schema_regex(schema: str, whitespace_pattern: str | None, stock: Callable[..., str]) -> str:
    """*stock*'s regex for a JSON schema, built in the compile guard's worker when that guard is on.

    With the guard on, the conversion needs it as much as the compile: for
    some real schemas outlines_core's conversion alone asks for gigabytes.
    The worker runs outlines_core's ``build_regex_from_schema``, which
    callers check *stock* is.
    """
    if not guarded():
        return stock(schema, whitespace_pattern)
    from outlines_maskcache.guard import regex_from_schema

    settings = RUNTIME.settings
    return regex_from_schema(schema, whitespace_pattern, settings.compile_timeout, settings.compile_max_bytes)
