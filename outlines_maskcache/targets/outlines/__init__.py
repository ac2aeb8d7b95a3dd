"""Adapters for outlines' own code paths: the 1.2-1.3 outlines_core backend and the 0.1-1.1 guide processor."""
