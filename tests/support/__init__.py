"""Helpers shared by the test modules: material (tokenizers, tiny models), hypothesis strategies, drivers, version markers."""
