"""Benchmarks: measured side by side and interleaved, never as timed tests."""
