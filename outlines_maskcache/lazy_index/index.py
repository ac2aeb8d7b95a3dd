"""The lazy Index: outlines_core 0.2's ``Index`` answered one state at a time from the byte-level Index.

Why each token's walk over the byte-level DFA gives exactly what
``Index::new`` gives, and where it cannot (then :class:`NotExact` is
raised and the full Index is built): docs/lazy-index.md, "Why it is exact".
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from outlines_maskcache.lazy_index.token_table import TokenTable

#: a byte-level DFA with more states than this is refused (its table is states x 256 int32)
MAX_BYTE_STATES = 1 << 16
#: and at most this many bytes of serialised byte-level Index (bincode's varints: ~4 bytes an edge); its
#: transitions read as Python dicts cost ~100 bytes an edge
MAX_BYTE_INDEX_BYTES = 32 << 20


class NotExact(ValueError):
    """The lazy Index cannot be proven equal to the full one for this regex and vocabulary: build the full one."""


def _pending_after(byte: int, pending: int) -> int:
    """UTF-8 continuation bytes still expected after *byte*, or -1 where no token sequence of whole characters goes."""
    if pending:
        return pending - 1 if 0x80 <= byte <= 0xBF else -1
    if byte < 0x80:
        return 0
    if 0xC2 <= byte <= 0xDF:
        return 1
    if 0xE0 <= byte <= 0xEF:
        return 2
    if 0xF0 <= byte <= 0xF4:
        return 3
    return -1


#: ``_PENDING_AFTER[pending, byte]``: :func:`_pending_after` as a table
_PENDING_AFTER = np.array([[_pending_after(b, p) for b in range(256)] for p in range(4)], dtype=np.int64)

#: rows at least this long are sorted by a scatter over the id range rather than argsort
_SCATTER_FROM = 2048


@dataclass
class StateTokens:
    """One state's row of the Index: allowed token ids (ascending, EOS included in a final state) and next states."""

    token_ids: np.ndarray
    next_states: np.ndarray

    def as_dict(self) -> dict[int, int]:
        return dict(zip(self.token_ids.tolist(), self.next_states.tolist()))


@dataclass
class LazyStats:
    states_built: int = 0
    seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, seconds: float) -> None:
        with self.lock:
            self.states_built += 1
            self.seconds += seconds


def _edges(transitions: Mapping[int, Mapping[int, int]]) -> np.ndarray:
    """(state, byte, next state) rows of a byte-level Index's transitions (its EOS entries left out)."""
    rows = list(transitions.values())
    counts = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    total = int(counts.sum())
    edges = np.empty((total, 3), dtype=np.int64)
    edges[:, 0] = np.repeat(np.fromiter(transitions.keys(), dtype=np.int64, count=len(rows)), counts)
    edges[:, 1] = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=total)
    edges[:, 2] = np.fromiter(chain.from_iterable(map(dict.values, rows)), dtype=np.int64, count=total)
    return edges[(edges[:, 1] >= 0) & (edges[:, 1] < 256)]


#: builds the regex's Index over the 256 one-byte tokens (ids 0-255) plus the two-byte tokens
#: ``bytes([b, witnesses[k]])`` (id ``256 + b * len(witnesses) + k``) and returns its transitions
Probe = Callable[[list[int]], Mapping[int, Mapping[int, int]]]


def _edges_into(orphans: np.ndarray, transitions: Mapping[int, Mapping[int, int]], probe: Probe) -> np.ndarray:
    """The byte-level edges the byte-level Index dropped: (state, byte, orphan) rows, recovered exactly.

    An edge ``s -b-> x`` is missing when ``x`` is dead, a quit state or bad.
    Two-byte probe tokens ``b c`` are kept by outlines_core whenever ``x``
    is not dead and ``c`` leads on to a good state, so the probe's row of
    (s, b) over the witness bytes ``c`` is ``x``'s own row over them: empty
    unless ``x`` is a bad state with a way on, i.e. an orphan.  Witnesses
    are chosen so that orphans with different rows differ on them; orphans
    with equal rows lead every token to the same place, so either may stand
    for the other.  This relies on a bad state never following a bad state:
    true of regex_automata's DFA (a match is reported one byte late, and a
    bad state's input is no match) unless look-around assertions decide
    matches, which the caller rules out.
    """
    rows = {int(o): dict(transitions[int(o)]) for o in orphans}
    witnesses: list[int] = sorted({min(b for b in row if b < 256) for row in rows.values()})

    def signature(row: Mapping[int, int]) -> tuple:
        return tuple(row.get(c) for c in witnesses)

    while True:
        by_signature: dict[tuple, list[int]] = {}
        for o, row in rows.items():
            by_signature.setdefault(signature(row), []).append(o)
        clash = next((group for group in by_signature.values()
                      if any(rows[o] != rows[group[0]] for o in group)), None)
        if clash is None:
            break
        first = rows[clash[0]]
        other = next(rows[o] for o in clash if rows[o] != first)
        differ = {b for b in set(first) | set(other) if b < 256 and first.get(b) != other.get(b)}
        witnesses.append(min(differ - set(witnesses)))  # all on witnesses would have made the signatures differ
    standing_for = {sig: group[0] for sig, group in by_signature.items()}
    probed = probe(witnesses)
    width = len(witnesses)
    found = []
    for s, row in probed.items():
        pairs: dict[int, dict[int, int]] = {}
        singles = set()
        for token, t in row.items():
            if token < 256:
                singles.add(token)
            elif token < 256 + 256 * width:
                b, k = divmod(token - 256, width)
                pairs.setdefault(b, {})[witnesses[k]] = t
        for b, seen in pairs.items():
            if b in singles:
                continue  # a recorded edge into a good state
            orphan = standing_for.get(signature(seen))
            if orphan is None:
                raise NotExact(f"state {s}, byte {b}: the probe names no orphan; the byte-level DFA is not understood")
            found.append((int(s), b, orphan))
    return np.array(found, dtype=np.int64).reshape(-1, 3)


def looks_around(regex: str) -> bool:
    """Whether *regex* may hold an anchor or word-boundary assertion (``^ $ \\b \\B \\A \\z``), conservatively.

    ``^`` that opens a character class and anything escaped or inside a
    class otherwise are literals; everything else that could be an
    assertion counts.
    """
    in_class, i = False, 0
    while i < len(regex):
        ch = regex[i]
        if ch == "\\":
            if not in_class and regex[i + 1:i + 2] in ("b", "B", "A", "z", "Z", "<", ">"):
                return True
            i += 2
            continue
        if in_class:
            if ch == "[":
                in_class = True
            elif ch == "]":
                in_class = False
        elif ch == "[":
            in_class = True
            i += 1
            if regex[i:i + 1] == "^":
                i += 1
            if regex[i:i + 1] == "]":
                i += 1
            continue
        elif ch in "^$":
            return True
        i += 1
    return False


#: largest id range (after dividing by the stride) that :class:`_DenseIds` maps with a presence array
_PRESENCE_RANGE = 1 << 20


class _DenseIds:
    """Sorted distinct state ids and each id's position among them.

    outlines_core's state ids are regex_automata's premultiplied ones
    (multiples of the DFA's stride), so dividing by their common stride
    gives a small range that a presence array turns into sorted positions
    without sorting; ids without such a range take ``np.unique``.
    """

    def __init__(self, ids: np.ndarray) -> None:
        ids = ids.astype(np.int64, copy=False)
        stride = int(np.gcd.reduce(ids)) if len(ids) else 1
        top = int(ids.max()) // max(stride, 1) if len(ids) else 0
        if stride > 0 and ids.min() >= 0 and top < _PRESENCE_RANGE:
            present = np.zeros(top + 1, dtype=bool)
            present[ids // stride] = True
            self.ids = np.flatnonzero(present) * stride
            self._position = np.cumsum(present, dtype=np.int32) - 1
            self._stride = stride
        else:
            self.ids = np.unique(ids)
            self._position = None
            self._stride = 0

    def of(self, ids: np.ndarray) -> np.ndarray:
        """Positions of *ids* (each one of the ids given at construction)."""
        if self._position is None:
            return np.searchsorted(self.ids, ids)
        return self._position[ids // self._stride]


class LazyIndex:
    """outlines_core 0.2's ``Index`` over a vocabulary, each state's row computed when first asked for.

    Built from the byte-level Index's transitions (byte token ``b`` is
    ``bytes([b])`` with id ``b``), final states and initial state; raises
    :class:`NotExact` where equality with the full Index cannot be proven.
    Rows are computed once and kept; concurrent first visits compute once.
    """

    def __init__(self, transitions: Mapping[int, Mapping[int, int]], final_states: Iterable[int],
                 initial_state: int, table: TokenTable, stats: LazyStats | None = None,
                 probe: Probe | None = None) -> None:
        #: processors serving this Index, handed the full one when it is compiled (weakly held)
        self.followers: weakref.WeakSet[Any] = weakref.WeakSet()
        self.initial_state = int(initial_state)
        self.final_states = frozenset(int(s) for s in final_states)
        self.eos_token_id = table.eos_token_id
        self.vocab_size = table.vocab_size
        self._table = table
        self.stats = stats if stats is not None else LazyStats()
        edges = _edges(transitions)
        keys = np.fromiter(transitions, dtype=np.int64, count=len(transitions))
        finals = np.fromiter(self.final_states, dtype=np.int64, count=len(self.final_states))
        dense = _DenseIds(np.concatenate([keys, edges[:, 2], finals, [self.initial_state]]))
        entered = np.zeros(len(dense.ids), dtype=bool)
        entered[dense.of(edges[:, 2])] = True
        entered[dense.of(np.array([self.initial_state]))] = True
        orphans = keys[~entered[dense.of(keys)]]
        if len(orphans):
            if probe is None:
                raise NotExact(f"{len(orphans)} DFA state(s) are entered only right after a complete match "
                               f"(e.g. {orphans.min()}); tokens that cross them are invisible to a byte-level walk")
            edges = np.concatenate([edges, _edges_into(orphans, transitions, probe)])
            dense = _DenseIds(np.concatenate([dense.ids, edges[:, 0], edges[:, 2]]))
        if len(dense.ids) > MAX_BYTE_STATES:
            raise NotExact(f"the byte-level DFA has {len(dense.ids)} states (> {MAX_BYTE_STATES})")
        states = dense.ids.tolist()
        #: dense position of each state id; row len(states) is the dead state
        self._dense = dict(zip(states, range(len(states))))
        self._state_ids = np.append(dense.ids, -1)
        self._dead = len(states)
        sources, targets = dense.of(edges[:, 0]), dense.of(edges[:, 2])
        step = np.full((len(states) + 1, 256), self._dead, dtype=np.int32)
        step[sources, edges[:, 1]] = targets
        self._step = step
        #: ``_steps[256 * s + b]`` is ``256 * step[s, b]``: the walk's one-gather step
        self._steps = (step * 256).ravel()
        #: states a token may cross but not end in (the orphans, which fail the end-of-token check), and the dead one
        self._bad = np.zeros(len(states) + 1, dtype=bool)
        self._bad[dense.of(orphans)] = True
        self._bad[self._dead] = True
        self._final = np.zeros(len(states) + 1, dtype=bool)
        self._final[dense.of(finals)] = True
        self._rows: dict[int, StateTokens] = {}
        self._row_of: Callable[[int], StateTokens | None] | None = None
        self._lock = threading.Lock()
        self._check_stock_compiles()

    def _check_stock_compiles(self) -> None:
        """Refuse where stock's compile could fail: a reachable, non-final state with no token of the vocabulary.

        Most states are cleared by a one-byte token on a recorded edge; the
        others (mid-character states of a vocabulary without lone bytes, say)
        get their rows computed now, and kept.
        """
        if self._table.whole_characters:
            reachable = self._character_boundaries()
        else:
            reachable = np.ones(self._dead + 1, dtype=bool)
        open_states = np.flatnonzero(reachable[:-1] & ~self._final[:-1] & ~self._bad[:-1])
        if not len(open_states):
            return
        singles = np.array(sorted(self._table.single_bytes), dtype=np.int64)
        if len(singles):
            cleared = (~self._bad[self._step[open_states[:, None], singles[None, :]]]).any(axis=1)
            open_states = open_states[~cleared]
        for state in self._state_ids[open_states].tolist():
            if not len(self.row(state).token_ids):
                raise NotExact(f"state {state} has no token of this vocabulary: stock's compile may fail "
                               "(IncompatibleVocabulary); only the full compile can tell")

    def _character_boundaries(self) -> np.ndarray:
        """Which dense states the start reaches by whole UTF-8 characters: all a vocabulary of whole characters reaches.

        A breadth-first walk over (state, continuation bytes still expected),
        one gather per level.  (A walk over the edge list costs more here:
        levels are many and small, so calls, not elements, dominate.)
        """
        # A pair is 4 * dense state + pending; `stamp` drops repeats in a level without sorting it.
        seen = np.zeros((self._dead + 1) * 4, dtype=bool)
        stamp = np.zeros((self._dead + 1) * 4, dtype=np.int64)
        pairs = np.array([self._dense[self.initial_state] * 4], dtype=np.int64)
        seen[pairs] = True
        while len(pairs):
            nxt, left = self._step[pairs // 4].astype(np.int64), _PENDING_AFTER[pairs % 4]
            keep = (nxt != self._dead) & (left >= 0)
            pairs = nxt[keep] * 4 + left[keep]
            pairs = pairs[~seen[pairs]]
            order = np.arange(len(pairs))
            stamp[pairs] = order
            pairs = pairs[stamp[pairs] == order]
            seen[pairs] = True
        return seen.reshape(-1, 4)[:, 0].copy()

    @property
    def known_states(self) -> frozenset[int]:
        """The DFA states the byte-level Index explored: every state a token sequence can reach."""
        return frozenset(self._dense)

    def is_final_state(self, state: int) -> bool:
        return state in self.final_states

    def computed_rows(self) -> dict[int, StateTokens]:
        """The rows computed so far (what has been served), by state."""
        with self._lock:
            return dict(self._rows)

    def row(self, state: int) -> StateTokens | None:
        """*state*'s allowed tokens and next states, or None for a state the DFA never reaches (stock's ``None``)."""
        found = self._rows.get(state)
        if found is not None:
            return found
        if self._row_of is None and state not in self._dense:
            return None
        with self._lock:
            found = self._rows.get(state)
            if found is None:
                if self._row_of is not None:
                    found = self._row_of(state)
                    if found is not None:
                        self._rows[state] = found
                    return found
                started = time.perf_counter()
                found = self._walk(state)
                self._rows[state] = found
                self.stats.add(time.perf_counter() - started)
        return found

    def adopt(self, row_of: Callable[[int], StateTokens | None], final_states: Iterable[int]) -> None:
        """Take every row from *row_of* from now on, forgetting those computed: the way out when a check found a difference.

        Guides already walking this Index (an engine's requests in flight)
        then follow the other Index at once, without being found one by one.
        """
        with self._lock:
            self._row_of = row_of
            self.final_states = frozenset(int(s) for s in final_states)
            self._rows = {}

    def allowed_tokens(self, state: int) -> list[int] | None:
        found = self.row(state)
        return None if found is None else found.token_ids.tolist()

    def next_state(self, state: int, token_id: int) -> int | None:
        """Stock's ``next_state``: None for EOS and for a token the state does not allow."""
        if token_id == self.eos_token_id:
            return None
        found = self.row(state)
        if found is None:
            return None
        at = int(np.searchsorted(found.token_ids, token_id))
        if at < len(found.token_ids) and found.token_ids[at] == token_id:
            return int(found.next_states[at])
        return None

    def _first_survivors(self, start: int) -> np.ndarray:
        """Positions of the tokens whose first two bytes *start* does not kill, ascending (the walk's cut needs them so).

        Most states allow few two-byte prefixes (JSON's optional space lets
        through the ~45% of a vocabulary that starts with one, but few of
        those survive their second byte): gathering those prefixes' runs
        costs a fraction of stepping all ~128k tokens.
        """
        table, step, dead = self._table, self._step, self._dead
        order, bounds = table.by_prefix()
        first = np.flatnonzero(step[start] != dead)
        second = step[step[start, first]] != dead
        keys = np.concatenate([(first[:, None] * 256 + np.arange(256))[second], 65536 + first])
        counts = bounds[keys + 1] - bounds[keys]
        total = int(counts.sum())
        if total * 4 > len(order):
            return np.arange(len(order), dtype=np.int64)
        keys, counts = keys[counts > 0], counts[counts > 0]
        offsets = np.repeat(bounds[keys] - np.cumsum(counts) + counts, counts)
        return np.sort(order[offsets + np.arange(total)])

    def _walk(self, state: int) -> StateTokens:
        """Every token's bytes from *state* at once: one gather per byte position over the tokens still alive.

        States are carried as ``256 * dense id`` so one step is an add and a
        gather (``_steps``).  Dead tokens stay in the arrays (the dead state
        steps to itself and fails the end check) until a quarter of them are
        dead: in a dense state (free text) few die, and while none has been
        dropped the positions are ``0..n`` and each byte column is a slice.
        """
        table, steps, dead = self._table, self._steps, self._dead * 256
        columns, longer_than = table.columns, table.longer_than
        start = self._dense[state]
        ended_at: list[np.ndarray] = []
        ended_in: list[np.ndarray] = []
        if columns.shape[0]:
            at = self._first_survivors(start)
            whole = len(at) == int(longer_than[0])  # then at is 0..n-1
            now = steps[(columns[0, : len(at)] if whole else columns[0, at]).astype(np.int32) + start * 256]
            for j in range(1, columns.shape[0] + 1):
                if not whole or j == 2:  # a dense walk looks once, after two bytes
                    alive = now != dead
                    n_alive = int(np.count_nonzero(alive))
                    if not n_alive:  # every token died: no need to look at longer ones
                        break
                    if n_alive * 4 < len(now) * 3:
                        at, now, whole = at[alive], now[alive], False
                if j >= len(longer_than):
                    cut = 0
                else:
                    cut = int(longer_than[j]) if whole else int(np.searchsorted(at, longer_than[j]))
                ends = now[cut:] >> 8
                good = ~self._bad[ends]
                ended_at.append(at[cut:][good])
                ended_in.append(ends[good])
                if cut == 0:
                    break
                at, now = at[:cut], now[:cut]
                now = steps[now + (columns[j, :cut] if whole else columns[j, at])]
        positions = np.concatenate(ended_at) if ended_at else np.empty(0, dtype=np.int64)
        dense_next = np.concatenate(ended_in) if ended_in else np.empty(0, dtype=np.int32)
        first_id, several = table.first_ids()
        flat, nexts = first_id[positions], self._state_ids[dense_next]
        extra_ids = [table.empty_ids]  # an empty token ends where it starts: allowed (the state is good)
        extra_next = [np.full(len(table.empty_ids), state, dtype=np.int64)]
        more = np.flatnonzero(several[positions])
        if len(more):  # the few tokens with several ids: the rest of their ids
            at_more = positions[more]
            starts, counts = table.id_start[at_more] + 1, table.id_start[at_more + 1] - table.id_start[at_more] - 1
            extra_ids.append(table.ids[np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))])
            extra_next.append(np.repeat(nexts[more], counts))
        if state in self.final_states:
            extra_ids.append(np.array([self.eos_token_id], dtype=np.int64))
            extra_next.append(np.array([state], dtype=np.int64))
        ids = np.concatenate([flat, *extra_ids])
        nexts = np.concatenate([nexts, *extra_next])
        if len(ids) < _SCATTER_FROM:
            order = np.argsort(ids, kind="stable")
            return StateTokens(ids[order], nexts[order])
        # Ids are distinct: a scatter over the id range sorts a dense row in a fraction of argsort's time.
        by_id = np.full(int(ids.max()) + 1, -1, dtype=np.int64)
        by_id[ids] = nexts
        sorted_ids = np.flatnonzero(by_id >= 0)
        return StateTokens(sorted_ids, by_id[sorted_ids])
