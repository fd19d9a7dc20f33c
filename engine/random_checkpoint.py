"""Checkpoints of random weights in a named shape, for benchmarks and device tests.

A machine that cannot hold or fetch a real checkpoint (the lent GPU machines carry at most
64 MiB; Llama-8B is 16 GB) still runs the real model code at the real shape: every weight of
``expected_weight_shapes`` is drawn from a normal distribution (norm weights are ones), on the
device asked for, from one seed. The same seed, shape and dtype give the same weights on every
device when drawn on the CPU (``device="cpu"``; move them after), so a CPU engine and a CUDA
engine can be compared on identical weights. The tokenizer is a word-level one over the
vocabulary (``t0``, ``t1``, ...): engines see token ids only.

Presets (``SHAPES``): ``llama-8b`` (Llama 3 8B's shape) and ``tiny`` (2 layers, hidden 256,
GQA 8/2, vocab 512) for fast correctness checks.
"""

from __future__ import annotations

import tokenizers
import torch

from splitserve.common.tokenizer import Tokenizer
from splitserve.engine.checkpoint import LoadedCheckpoint, expected_weight_shapes
from splitserve.engine.model_config import ModelArchConfig

SHAPES: dict[str, ModelArchConfig] = {
    "llama-8b": ModelArchConfig(
        name="random-llama-8b",
        architecture="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        eos_token_ids=(128001,),
    ),
    "tiny": ModelArchConfig(
        name="random-tiny",
        architecture="llama",
        vocab_size=512,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_ids=(1,),
    ),
}


def word_tokenizer(vocab_size: int) -> Tokenizer:
    """A word-level tokenizer whose token ``i`` is the word ``t{i}`` (unknown words: ``t0``)."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend)


def random_checkpoint(
    config: ModelArchConfig,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
    std: float = 0.02,
) -> LoadedCheckpoint:
    """Every weight of ``config`` drawn ``N(0, std^2)`` (norm weights: ones) in ``dtype`` on
    ``device``, from a generator on that device seeded with ``seed``."""
    generator = torch.Generator(device=device).manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in expected_weight_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=dtype, device=device)
            continue
        tensor = torch.empty(shape, dtype=torch.float32, device=device)
        tensor.normal_(0.0, std, generator=generator)
        weights[name] = tensor.to(dtype)
    return LoadedCheckpoint(
        config=config, weights=weights, tokenizer=word_tokenizer(config.vocab_size)
    )
