"""Test material comes from the package's benchmark loaders (one implementation for both)."""

from outlines_maskcache.bench.material import (  # noqa: F401
    gpt2_tokenizer,
    llama3_tokenizer,
    mistral_tokenizer,
    package_dir,
    smollm2_gguf,
    tiny_model,
)
