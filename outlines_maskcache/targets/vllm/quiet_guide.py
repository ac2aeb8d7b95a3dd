"""An outlines_core ``Guide`` whose ``advance`` builds no token list nobody reads.

``Guide.advance(token)`` returns the list of every token allowed next (up
to the whole vocabulary), which vLLM's ``accept_tokens`` and
``_is_finished_after`` discard; it was most of the engine's time in an
offline profile (docs/engines.md).  Rewriting vLLM's methods would freeze
one release's termination rules, so the guide looks at its caller: when
the next bytecode instruction after the call is ``POP_TOP`` it passes
``return_tokens=False``; in every other case, or a shape it does not
know, it builds the list as stock.  The transition is the same call
either way.  The answer is cached per (code object, offset).
"""

from __future__ import annotations

import bisect
import dis
import sys
from types import CodeType
from typing import Any

#: (code object, offset of the call) -> the call's result is discarded
_discarded: dict[tuple[CodeType, int], bool] = {}
_DISCARD_OPS = frozenset({"POP_TOP"})


def _result_discarded(code: CodeType, offset: int) -> bool:
    key = (code, offset)
    known = _discarded.get(key)
    if known is None:
        known = False
        instructions = list(dis.get_instructions(code))
        # f_lasti points into the call instruction (at its first code unit
        # or, on 3.11, its last inline-cache unit): the call is the last
        # instruction starting at or before it.
        at = bisect.bisect_right([ins.offset for ins in instructions], offset) - 1
        # It must be a call: anything else means f_lasti does not point where
        # this module expects (a new interpreter), so assume the result is used.
        if 0 <= at < len(instructions) - 1 and instructions[at].opname.startswith("CALL"):
            known = instructions[at + 1].opname in _DISCARD_OPS
        if len(_discarded) > 4096:  # code objects of exec'd strings must not pile up
            _discarded.clear()
        _discarded[key] = known
    return known


class QuietGuide:
    """Wraps a ``Guide``: the same methods and states; ``advance`` skips the list its caller drops."""

    __slots__ = ("inner", "accepts_tokens", "get_state", "is_finished", "rollback_state", "write_mask_into",
                 "reset", "get_tokens")

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        # Bound methods of the Rust object: no Python wrapper on the hot path.
        for name in QuietGuide.__slots__[1:]:
            method = getattr(inner, name, None)
            if method is not None:
                setattr(self, name, method)

    def advance(self, token_id: int, return_tokens: bool | None = None) -> Any:
        if return_tokens is None:
            frame = sys._getframe(1)
            if _result_discarded(frame.f_code, frame.f_lasti):
                return self.inner.advance(token_id, False)
            return self.inner.advance(token_id)
        return self.inner.advance(token_id, return_tokens)

    def __getattr__(self, name: str) -> Any:
        # Only reached for what __slots__ does not hold (a method newer
        # outlines_core added, or one this instance's inner lacks).
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"QuietGuide({self.inner!r})"

    def __reduce__(self) -> Any:
        return (QuietGuide, (self.inner,))
