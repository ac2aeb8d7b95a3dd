"""outlines_core 0.2's ``Guide`` over a lazy Index, so stock's processors and vLLM's grammars run unchanged on one."""

from __future__ import annotations

import ctypes
from collections import deque
from typing import Iterable

import numpy as np

from outlines_maskcache.lazy_index.index import LazyIndex

#: the capacity Rust's ``VecDeque<u32>`` grows to from zero (``RawVec``'s
#: minimum non-zero capacity for items of 4 bytes)
_RUST_MIN_CAPACITY = 4


class LazyGuide:
    """outlines_core 0.2's ``Guide`` over a :class:`LazyIndex`: the same states, answers and errors.

    What stock's processors call (``get_state``, ``advance``,
    ``is_finished``, ``accepts_tokens``, ``write_mask_into``, ``reset``,
    ``rollback_state``) behaves as the Rust ``Guide`` does, messages
    included; a state's row is computed on its first visit.
    """

    def __init__(self, index: LazyIndex, max_rollback: int = 32) -> None:
        if max_rollback < 0:  # the Rust signature takes a usize
            raise OverflowError("can't convert negative int to unsigned")
        self.index = index
        self._state = index.initial_state
        self._previous: deque[int] = deque()
        self._capacity = max_rollback

    def get_state(self) -> int:
        return self._state

    def get_tokens(self) -> list[int]:
        tokens = self.index.allowed_tokens(self._state)
        if tokens is None:
            raise ValueError(f"No allowed tokens available for the state {self._state}")
        return tokens

    def get_allowed_rollback(self) -> int:
        return len(self._previous)

    def advance(self, token_id: int, return_tokens: bool | None = None) -> list[int] | None:
        new_state = self.index.next_state(self._state, token_id)
        if new_state is None:
            raise ValueError(f"No next state found for the current state: {self._state} with token ID: {token_id}")
        # The Rust Guide keeps its past states in a VecDeque made with
        # capacity max_rollback, dropping the oldest when it is full.  With
        # max_rollback=0 (vLLM's default, no speculative decoding) the first
        # push grows it to Rust's minimum capacity for 4-byte items, so stock
        # can roll back up to 4 steps there: the same rule, kept here.
        if len(self._previous) == self._capacity:
            if self._previous:
                self._previous.popleft()
            else:
                self._capacity = _RUST_MIN_CAPACITY
        self._previous.append(self._state)
        self._state = new_state
        return self.get_tokens() if return_tokens is None or return_tokens else None

    def rollback_state(self, n: int) -> None:
        if n == 0:
            return
        if n > len(self._previous):
            raise ValueError(f"Cannot roll back {n} step(s): only {len(self._previous)} states stored "
                             f"(max_rollback = {self._capacity}). You must advance through at least {n} "
                             f"state(s) before rolling back {n} step(s).")
        for _ in range(n):
            self._state = self._previous.pop()

    def accepts_tokens(self, sequence: Iterable[int]) -> bool:
        state: int | None = self._state
        for token in sequence:
            state = self.index.next_state(state, token)  # type: ignore[arg-type]
            if state is None:
                return False
        return True

    def is_finished(self) -> bool:
        return self.index.is_final_state(self._state)

    def reset(self) -> None:
        self._state = self.index.initial_state

    def write_mask_into(self, data_ptr: int, numel: int, element_size: int) -> None:
        """The state's bitmask into caller memory, with the Rust ``Guide``'s checks and layout."""
        expected = (self.index.vocab_size + 31) // 32
        if element_size != 4:
            raise ValueError(f"Invalid element size: got {element_size} bytes per element, "
                             "expected 4 bytes (32-bit integer).")
        if data_ptr == 0:
            raise ValueError("Invalid data pointer: received a null pointer.")
        if data_ptr % 4:
            raise ValueError(f"Invalid data pointer alignment: pointer address {data_ptr} is not a multiple of 4.")
        if numel < expected:
            raise ValueError(f"Invalid buffer size: got {numel} elements ({numel * element_size} bytes), expected "
                             f"{expected} elements ({expected * 4} bytes). Ensure that the mask tensor has shape "
                             "(1, (vocab_size + 31) // 32) and uses 32-bit integers.")
        out = np.ctypeslib.as_array(ctypes.cast(data_ptr, ctypes.POINTER(ctypes.c_uint32)), shape=(numel,))
        row = self.index.row(self._state)
        bits = np.zeros(numel * 32, dtype=np.uint8)
        if row is not None and len(row.token_ids):
            bits[row.token_ids[row.token_ids < numel * 32]] = 1
        # little-endian bit order within each byte, then bytes as little-endian words: the Rust layout
        out[:] = np.packbits(bits, bitorder="little").view("<u4")

    def __repr__(self) -> str:
        return f"LazyGuide(state={self._state})"
