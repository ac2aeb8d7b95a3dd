"""A vocabulary's tokens as bytes, laid out for the lazy Index's vectorised walk, and their store layout.

Built once per vocabulary (~1 s at 128k tokens) and kept in the grammar
store beside it, in a checked layout of its own: a JSON header, then raw
integer arrays; never pickled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np


@dataclass
class TokenTable:
    """A vocabulary's tokens as outlines_core iterates them, laid out for a vectorised walk.

    Tokens are the distinct byte strings (each with all its ids), EOS's own
    excluded as ``Index::new`` excludes it, sorted by length, longest
    first, so the tokens still walking after byte ``j`` are a prefix.
    """

    eos_token_id: int
    #: byte ``j`` of the token at sorted position ``i`` is ``columns[j, i]`` (0 past its end)
    columns: np.ndarray
    #: ``longer_than[j]``: how many tokens have more than ``j`` bytes (a prefix of the order)
    longer_than: np.ndarray
    #: ids of the token at sorted position ``i``: ``ids[id_start[i]:id_start[i + 1]]``
    ids: np.ndarray
    id_start: np.ndarray
    #: ids of empty tokens (allowed wherever the state itself passes the check)
    empty_ids: np.ndarray
    single_bytes: frozenset[int]
    #: every token is whole UTF-8 characters, so a token sequence never stops inside a character
    whole_characters: bool
    #: outlines_core's ``Vocabulary.len()``: every id of every token, plus one for EOS
    vocab_size: int
    _first: tuple[np.ndarray, np.ndarray] | None = field(default=None, init=False, repr=False, compare=False)
    _one_id: tuple[np.ndarray, np.ndarray] | None = field(default=None, init=False, repr=False, compare=False)

    def first_ids(self) -> tuple[np.ndarray, np.ndarray]:
        """(each position's first id, whether it has more): nearly every token has one id, so rows skip the general expansion."""
        if self._one_id is None:
            counts = np.diff(self.id_start)
            self._one_id = (self.ids[self.id_start[:-1]] if len(counts) else np.empty(0, np.int64), counts != 1)
        return self._one_id

    def by_prefix(self) -> tuple[np.ndarray, np.ndarray]:
        """(positions ordered by their first two bytes, ascending within a run; offsets of each run): built on first use.

        A run's key is ``256 * b1 + b2`` for tokens of two bytes or more and
        ``65536 + b1`` for one-byte tokens.
        """
        if self._first is None:
            n, n_long = int(self.longer_than[0]) if len(self.longer_than) else 0, 0
            keys = np.empty(n, dtype=np.int64)
            if self.columns.shape[0]:
                n_long = int(self.longer_than[1]) if len(self.longer_than) > 1 else 0
                keys[:n_long] = self.columns[0, :n_long].astype(np.int64) * 256
                if self.columns.shape[0] > 1:
                    keys[:n_long] += self.columns[1, :n_long]
                keys[n_long:] = 65536 + self.columns[0, n_long:n].astype(np.int64)
            order = np.argsort(keys, kind="stable")
            self._first = (order, np.searchsorted(keys[order], np.arange(65536 + 257)))
        return self._first

    @classmethod
    def of(cls, tokens: Mapping[bytes, Iterable[int]], eos_token_id: int) -> TokenTable:
        kept: list[tuple[bytes, list[int]]] = []
        empty: list[int] = []
        vocab_size = 1
        for token, ids in tokens.items():
            ids = list(ids)
            vocab_size += len(ids)
            if eos_token_id in ids:
                continue
            if token:
                kept.append((bytes(token), ids))
            else:
                empty.extend(ids)
        kept.sort(key=lambda item: -len(item[0]))
        lengths = np.fromiter((len(t) for t, _ in kept), dtype=np.int64, count=len(kept))
        width = int(lengths[0]) if len(kept) else 0
        columns = np.zeros((width, len(kept)), dtype=np.uint8)
        starts = np.cumsum(lengths) - lengths
        total = int(lengths.sum())
        # byte k of every token at once: its position in the token, and the token's column
        columns[np.arange(total) - np.repeat(starts, lengths), np.repeat(np.arange(len(kept)), lengths)] = \
            np.frombuffer(b"".join(t for t, _ in kept), dtype=np.uint8)
        longer_than = len(kept) - np.cumsum(np.bincount(lengths, minlength=width + 1))[:width]
        counts = np.fromiter((len(ids) for _, ids in kept), dtype=np.int64, count=len(kept))
        id_start = np.zeros(len(kept) + 1, dtype=np.int64)
        np.cumsum(counts, out=id_start[1:])
        flat = np.fromiter((i for _, ids in kept for i in ids), dtype=np.int64, count=int(id_start[-1]))
        singles = frozenset(t[0] for t, _ in kept if len(t) == 1)
        return cls(eos_token_id, columns, longer_than, flat, id_start, np.array(sorted(empty), dtype=np.int64),
                   singles, all(_whole_characters(t) for t, _ in kept), vocab_size)

    _ARRAYS = ("columns", "longer_than", "ids", "id_start", "empty_ids")

    def to_bytes(self) -> bytes:
        """A self-describing layout (a JSON header, then raw arrays) for the grammar store: never pickle."""
        arrays = [np.ascontiguousarray(getattr(self, name)) for name in self._ARRAYS]
        header = {"eos": self.eos_token_id, "singles": sorted(self.single_bytes), "whole": self.whole_characters,
                  "vocab_size": self.vocab_size,
                  "arrays": [[name, a.dtype.str, list(a.shape)] for name, a in zip(self._ARRAYS, arrays)]}
        head = json.dumps(header).encode()
        return b"".join([_TABLE_MAGIC, len(head).to_bytes(4, "little"), head, *(a.tobytes() for a in arrays)])

    @classmethod
    def from_bytes(cls, data: bytes) -> TokenTable:
        """The table :meth:`to_bytes` wrote; ``ValueError`` for anything else (a miss for the store's reader)."""
        if not data.startswith(_TABLE_MAGIC):
            raise ValueError("not a token table")
        at = len(_TABLE_MAGIC) + 4
        size = int.from_bytes(data[len(_TABLE_MAGIC):at], "little")
        header = json.loads(data[at:at + size])
        at += size
        arrays = {}
        for name, dtype, shape in header["arrays"]:
            if name not in cls._ARRAYS or np.dtype(dtype).kind not in "iu":
                raise ValueError(f"token table: unexpected array {name} {dtype}")
            count = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            if at + count > len(data):
                raise ValueError("token table: cut short")
            arrays[name] = np.frombuffer(data, dtype=dtype, count=count // np.dtype(dtype).itemsize,
                                         offset=at).reshape(shape)
            at += count
        if at != len(data) or set(arrays) != set(cls._ARRAYS):
            raise ValueError("token table: wrong length or arrays")
        table = cls(int(header["eos"]), arrays["columns"], arrays["longer_than"], arrays["ids"], arrays["id_start"],
                    arrays["empty_ids"], frozenset(int(b) for b in header["singles"]), bool(header["whole"]),
                    int(header["vocab_size"]))
        width, count = table.columns.shape
        if len(table.longer_than) != width or len(table.id_start) != count + 1 or \
                (count and (table.id_start[-1] != len(table.ids) or table.longer_than[0] != count)):
            raise ValueError("token table: inconsistent arrays")
        return table


_TABLE_MAGIC = b"OMCTT1\x00\x00"


def _whole_characters(token: bytes) -> bool:
    try:
        token.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
