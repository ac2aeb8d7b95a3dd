"""A state-by-state stand-in for outlines_core 0.2's ``Index``: each state's tokens computed on first visit.

Stock's ``Index::new`` walks every token from every DFA state before the
first mask; a generation visits a fraction of those states.  This package
answers the same questions one state at a time, from the *byte-level*
Index of the same regex (256 one-byte tokens, milliseconds to build), and
refuses any regex where that walk could differ from the full Index.  Why
the walk is exact, and each refusal: docs/lazy-index.md.

It knows nothing of outlines: it takes the byte-level Index's transitions
and the vocabulary's tokens as plain data.
"""

from outlines_maskcache.lazy_index.guide import LazyGuide
from outlines_maskcache.lazy_index.index import (
    MAX_BYTE_INDEX_BYTES,
    MAX_BYTE_STATES,
    LazyIndex,
    LazyStats,
    NotExact,
    Probe,
    StateTokens,
    looks_around,
)
from outlines_maskcache.lazy_index.token_table import TokenTable

__all__ = ["MAX_BYTE_INDEX_BYTES", "MAX_BYTE_STATES", "LazyGuide", "LazyIndex", "LazyStats", "NotExact", "Probe",
           "StateTokens", "TokenTable", "looks_around"]
