"""Every call this package makes into outlines_core, in one place (numpy imported lazily: the guard's worker loads this).

outlines_core is the one library whose objects the cache, the store and
the adapters all handle: its ``Index`` and ``Vocabulary`` (compiled,
serialised with their own ``from_binary`` format, never pickled), its
guides' ``write_mask_into`` (the stock mask of a state) and, on the 0.1
line, its Python ``RegexGuide`` whose ``get_next_instruction`` lists the
allowed tokens.  Keeping the calls here means an outlines_core release
that changes one of them is fixed once, for every caller.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
from array import array
from operator import itemgetter
from typing import TYPE_CHECKING, Any, Callable

from outlines_maskcache.fingerprint import digest

if TYPE_CHECKING:
    import numpy as np

#: registry fingerprints of vocabularies named by their content: only an
#: Index over such a vocabulary can be named, hence stored
VOCABULARY_PREFIX = "vocab:"
#: tokens whose converted strings enter a vocabulary's key: they pin the
#: tokenizer's decoding rules (byte-level, SentencePiece...) beside its table
_PROBES = 97


@functools.lru_cache(maxsize=None)
def version() -> str:
    """The installed outlines_core release: its binary format and its compiler are part of every key."""
    try:
        return importlib.metadata.version("outlines_core")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - vendored builds
        import outlines_core

        return str(getattr(outlines_core, "__version__", "unknown"))


def is_own(name: str, obj: Any) -> bool:
    """Whether *obj* is outlines_core's own *name* (``Index``, ``Vocabulary``), not a stand-in a test put there."""
    import outlines_core

    return obj is getattr(outlines_core, name, None)


def has_python_index() -> bool:
    """Whether this outlines_core has the 0.2 line's Python ``Index`` (the 0.1 line has ``RegexGuide`` only)."""
    import outlines_core

    return hasattr(outlines_core, "Index")


# -- compiled objects ------------------------------------------------------------

def new_index(regex: str, vocabulary: Any) -> Any:
    from outlines_core import Index

    return Index(regex, vocabulary)


def load_index(data: bytes) -> Any:
    from outlines_core import Index

    return Index.from_binary(data)


def load_vocabulary(data: bytes) -> Any:
    from outlines_core import Vocabulary

    return Vocabulary.from_binary(data)


def binary_of(obj: Any) -> bytes:
    """The ``from_binary`` bytes of an outlines_core object, from its own ``__reduce__``.

    Only that exact shape is accepted: anything else would need pickle.
    """
    reduced = obj.__reduce__()
    if not (isinstance(reduced, tuple) and len(reduced) == 2 and getattr(reduced[0], "__name__", "") == "from_binary"
            and len(reduced[1]) == 1 and isinstance(reduced[1][0], (bytes, bytearray))):
        raise TypeError(f"{type(obj).__name__} does not serialise through from_binary")
    return bytes(reduced[1][0])


def schema_regex(schema: str, whitespace_pattern: str | None = None) -> str:
    """outlines_core's regex for a JSON *schema*: what outlines' backend builds (default whitespace unless given)."""
    return schema_regex_function()(schema, whitespace_pattern)


def schema_regex_function() -> Callable[..., str]:
    """outlines_core's ``build_regex_from_schema`` (its home moved between releases)."""
    try:
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:  # pragma: no cover - the 0.1 line
        from outlines_core.fsm.json_schema import build_regex_from_schema
    return build_regex_from_schema


def byte_level_index(regex: str) -> Any:
    """outlines_core's ``Index`` of *regex* over the 256 one-byte tokens (token ``b`` is ``bytes([b])``, EOS 256).

    Built by the very loop that builds the full Index, so its state ids,
    recorded edges and final states are the DFA's (see ``lazy_index``).
    """
    return new_index(regex, _byte_vocabulary([]))


def index_rows(index: Any) -> tuple[dict[int, dict[int, int]], set[int], int]:
    """(transitions, final states, initial state) of an outlines_core Index, as plain Python data."""
    return index.get_transitions(), set(index.get_final_states()), index.get_initial_state()


def index_row(index: Any, state: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(allowed token ids ascending, next state of each) of *state* in a full Index; EOS's next state is *state*.

    Stock's own answers, one ``get_next_state`` call per token: slow
    (tens of ms at 128k tokens), for the rare path that must not trust a
    lazy row (:meth:`LazyIndex.adopt`).
    """
    import numpy as np

    tokens = index.get_allowed_tokens(state)
    if tokens is None:
        return None
    ids = np.unique(np.asarray(tokens, dtype=np.int64))
    nexts = [index.get_next_state(state, token) for token in ids.tolist()]
    return ids, np.array([state if n is None else n for n in nexts], dtype=np.int64)


def vocabulary_tokens(vocabulary: Any) -> tuple[dict[bytes, list[int]], int]:
    """(token bytes -> ids, EOS id) exactly as outlines_core's ``Vocabulary`` holds them.

    outlines_core gives Python no way to list a vocabulary's tokens, so
    this reads its ``from_binary`` bytes (bincode's standard layout: the
    EOS id, then the token map).  The reading is checked against the
    object: every byte consumed, the EOS id and a spread of tokens equal to
    what ``get`` answers; anything else raises ``ValueError`` (a layout
    this release does not have), never a guess.
    """
    data = binary_of(vocabulary)
    at = 0

    def varint() -> int:
        nonlocal at
        if at >= len(data):
            raise ValueError("vocabulary bytes end early")
        first = data[at]
        at += 1
        if first < 251:
            return first
        size = {251: 2, 252: 4, 253: 8}.get(first)
        if size is None or at + size > len(data):
            raise ValueError(f"vocabulary bytes: varint tag {first} is not one we read")
        value = int.from_bytes(data[at:at + size], "little")
        at += size
        return value

    eos = varint()
    tokens: dict[bytes, list[int]] = {}
    size = len(data)
    for _ in range(varint()):
        length = data[at] if at < size and data[at] < 251 else -1
        if length >= 0:
            at += 1
        else:
            length = varint()
        if at + length > size:
            raise ValueError("vocabulary bytes end inside a token")
        token = data[at:at + length]
        at += length
        count = data[at] if at < size and data[at] < 251 else -1
        if count >= 0:
            at += 1
        else:
            count = varint()
        ids = []
        for _ in range(count):  # ids below 251 are one byte: read them without a call
            if at < size and data[at] < 251:
                ids.append(data[at])
                at += 1
            else:
                ids.append(varint())
        tokens[token] = ids
    if at != len(data) or eos != vocabulary.get_eos_token_id():
        raise ValueError("vocabulary bytes are not in the layout this reader knows")
    items = list(tokens.items())
    for token, ids in items[:: max(1, len(items) // 64)]:
        if sorted(vocabulary.get(token) or []) != sorted(ids):
            raise ValueError("vocabulary bytes disagree with Vocabulary.get")
    return tokens, eos


def lazy_index(regex: str, vocabulary: Any, table: Any = None, stats: Any = None,
               compile: Callable[[str, Any, str], Any] | None = None) -> Any:
    """A :class:`~outlines_maskcache.lazy_index.LazyIndex` of *regex* over *vocabulary*, equal to ``Index(regex, vocabulary)``.

    Raises ``NotExact`` where that cannot be proven, and whatever
    outlines_core raises for the byte-level Index.  *table*: the vocabulary's
    ``TokenTable`` when at hand (building one takes about a second at 128k
    tokens); *compile* ``(regex, vocabulary, name) -> Index`` builds the
    byte-level and probe Indexes elsewhere (the compile guard's worker).
    """
    from outlines_maskcache.lazy_index import MAX_BYTE_INDEX_BYTES, LazyIndex, NotExact, TokenTable

    if table is None:
        table = TokenTable.of(*vocabulary_tokens(vocabulary))
    build = compile or (lambda r, v, _name: new_index(r, v))
    byte = build(regex, _byte_vocabulary([]), "lazy:bytes")
    # Sized before its transitions become Python dicts (gigabytes for a DFA of 10^5+ states).
    size = len(binary_of(byte))
    if size > MAX_BYTE_INDEX_BYTES:
        raise NotExact(f"the byte-level DFA has a {size / 2**20:,.0f} MiB Index (> {MAX_BYTE_INDEX_BYTES >> 20} MiB)")
    return LazyIndex(*index_rows(byte), table, stats=stats, probe=functools.partial(_probe_transitions, regex, build))


def _byte_vocabulary(witnesses: list[int]) -> Any:
    """The 256 one-byte tokens (ids 0-255) and the two-byte probe tokens ``b + witness``; EOS after them."""
    from outlines_core import Vocabulary

    tokens: dict[bytes, list[int]] = {bytes([b]): [b] for b in range(256)}
    for b in range(256):
        for k, c in enumerate(witnesses):
            tokens[bytes([b, c])] = [256 + b * len(witnesses) + k]
    return Vocabulary(256 + 256 * len(witnesses), tokens)


def _probe_transitions(regex: str, build: Callable[[str, Any, str], Any],
                       witnesses: list[int]) -> dict[int, dict[int, int]]:
    """The transitions of *regex*'s Index over the one-byte tokens and the two-byte tokens ``b + witness``.

    Only asked for where the byte-level Index has states after a complete
    match; refused for a regex whose assertions may decide matches (see
    :func:`~outlines_maskcache.lazy_index.looks_around`).
    """
    from outlines_maskcache.lazy_index import NotExact, looks_around

    if looks_around(regex):
        raise NotExact("DFA states entered only right after a complete match, in a regex with assertions: "
                       "the probe that recovers the edges into them is not trusted there")
    return build(regex, _byte_vocabulary(witnesses), f"lazy:probe:{witnesses}").get_transitions()


# -- masks -----------------------------------------------------------------------

def write_words(guide: Any, n_words: int) -> np.ndarray:
    """The int32 bitmask of *guide*'s current state: the very call stock makes, into a row shaped as stock's (read-only)."""
    import numpy as np

    row = np.empty(n_words, dtype=np.int32)
    guide.write_mask_into(row.ctypes.data, n_words, row.itemsize)
    row.setflags(write=False)
    return row


def allowed_by_state(guide: Any) -> bool:
    """True when *guide*'s allowed tokens are a function of its state alone (so masks can be cached per state).

    True of outlines_core 0.1's Python ``RegexGuide`` (and subclasses that
    keep its ``get_next_instruction``); not of ``CFGGuide`` or of a subclass
    that overrides it.
    """
    from outlines_core.fsm.guide import RegexGuide as CoreRegexGuide

    return isinstance(guide, CoreRegexGuide) and \
        type(guide).get_next_instruction is CoreRegexGuide.get_next_instruction


def instruction_ids(tokens: Any) -> np.ndarray:
    """A 0.1-line guide's ``Instruction.tokens`` as a numpy id array.

    Anything stock could not use as an index (``None``, an empty float
    tensor) raises here, so the step runs stock and fails as stock fails.
    """
    import numpy as np

    if hasattr(tokens, "detach"):  # a torch tensor, possibly on a device
        tokens = tokens.detach().cpu().numpy()
    ids = np.asarray(tokens)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"allowed tokens of dtype {ids.dtype} are not token ids")
    return ids


# -- vocabularies ----------------------------------------------------------------

def vocabulary_key(vocab: dict[str, int], eos_token_id: Any, eos_token: Any,
                   token_to_str: Callable[[str], str] | None, *extra: object, ordered: bool = False) -> str:
    """A content key (prefixed :data:`VOCABULARY_PREFIX`) for a tokenizer vocabulary as a converter sees it.

    It covers every (token, id) pair, the EOS token and id, and the converted
    strings of a spread of tokens, so one table under different decoding
    rules gets different keys.  *ordered*: the converter's result depends on
    the mapping's order (a later token overwrites one that decodes alike),
    so the key covers the order too.
    """
    if ordered:
        h = hashlib.sha256(b"ordered\x00")
        for token, token_id in vocab.items():
            h.update(token.encode("utf-8", "surrogatepass"))
            h.update(b"\x00" + repr(token_id).encode() + b"\x00")
        return VOCABULARY_PREFIX + digest("vocabulary", h.hexdigest(), eos_token_id, eos_token,
                                          *_probes(list(vocab), token_to_str, eos_token), *extra)
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
    return VOCABULARY_PREFIX + digest("vocabulary", h.hexdigest(), eos_token_id, eos_token,
                                      *_probes(tokens, token_to_str, eos_token), *extra)


def _probes(tokens: list[str], token_to_str: Callable[[str], str] | None, eos_token: Any) -> tuple[Any, Any]:
    """(the converted EOS, converted strings of a spread of tokens): they pin the decoding rules."""
    if token_to_str is None:
        return None, None
    step = max(1, len(tokens) // _PROBES)
    return (token_to_str(eos_token) if eos_token else None), [token_to_str(token) for token in tokens[::step]]


def is_vocabulary_key(fingerprint: Any) -> bool:
    return isinstance(fingerprint, str) and fingerprint.startswith(VOCABULARY_PREFIX)
