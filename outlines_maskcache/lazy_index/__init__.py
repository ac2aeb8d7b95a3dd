"""A state-by-state stand-in for outlines_core 0.2's ``Index``: each state's tokens computed on first visit (#29).

outlines_core's ``Index::new`` walks every token of the vocabulary from
every state of regex_automata's DFA before the first mask can be served
(about 2.4 ms a state at 128k tokens: seconds for a large schema).  A
generation visits a fraction of those states.  This package answers the
same questions, for one state at a time, from a *byte-level* Index (the
same regex over 256 one-byte tokens, which outlines_core builds in
milliseconds):

* ``Index::new`` keeps a token from state ``s`` when its bytes never reach
  a dead or quit state and the state it ends in, ``t``, passes the
  end-of-token check: ``t`` is not a match state, or the input would be a
  complete match at ``t``.  The check depends on ``t`` alone.  Call a state
  that fails it *bad*: regex_automata reports a match one byte late, so a
  bad state is one entered by the byte right after a complete match.
* The byte-level Index is built by that same loop over one-byte tokens, so
  it records exactly the DFA edges into good states, and it explores every
  state reachable from the start (a state is explored even when the edge
  into it fails the check).  Its state ids are the DFA's, as the full
  Index's are.
* A token whose path stays on good states is therefore walked exactly
  through the recorded edges, and ends where the full Index says.  Only a
  token that *crosses* a bad state is invisible to the walk.  Such a token
  ends in a good state, so the last bad state on its path has a recorded
  edge out while no recorded edge enters it: an *orphan* of the byte-level
  Index (a key of its transitions that is neither a target nor the start,
  which regex_automata never makes a match state).  No orphans means no
  such token exists, and the walk equals the full Index on every state.
  Orphans exist where a regex can go on past a complete match (a URI
  format's ``[^\\s]*`` absorbing the closing ``"}``): there the lazy Index
  is refused, never approximated.
* Stock's compile fails (``IncompatibleVocabulary``) when a state it
  explores is neither a match state nor has a valid token.  With no
  orphans, no token leads out of a bad state to a good one, so the good
  states stock explores are those a token sequence reaches, all of them
  known to the byte-level Index.  The lazy Index is refused unless every
  known non-final state has a valid token (most are cleared by a one-byte
  token; the rest have their rows computed up front), so it is used only
  where stock's compile succeeds.

This package knows nothing of outlines: it takes the byte-level Index's
transitions and the vocabulary's tokens as plain data.
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
