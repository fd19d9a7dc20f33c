"""Checkpoints of random weights in a named shape, for benchmarks and device tests.

A machine that cannot hold or fetch a real checkpoint (the lent GPU machines carry at most
64 MiB; Llama-8B is 16 GB) still runs the real model code at the real shape: every weight of
``expected_weight_shapes`` is drawn from a normal distribution (norm weights are ones), on the
device asked for, from one seed. The same seed, shape and dtype give the same weights on every
device when drawn on the CPU (``device="cpu"``; move them after), so a CPU engine and a CUDA
engine can be compared on identical weights. The tokenizer is a word-level one over the
vocabulary (``t0``, ``t1``, ...): engines see token ids only.

Presets (``SHAPES``): ``llama-8b`` (Llama 3 8B's shape), ``llama-1b`` (Llama 3.2 1B's,
untied) and ``tiny`` (2 layers, hidden 256,
GQA 8/2, vocab 512) for fast correctness checks.

``save_random_model`` writes such a checkpoint as an HF folder (``config.json``,
``model.safetensors``, ``tokenizer.json`` with a plain chat template) that every role loads
like any other model (``--model DIR``): a second, differently shaped model for a cluster that
serves several (``splitserve up --extra-model DIR``), without fetching one::

    python -m splitserve.engine.random_checkpoint --shape tiny --out /tmp/random-tiny
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import tokenizers
import torch
from safetensors.torch import save_file

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
    "llama-1b": ModelArchConfig(
        name="random-llama-1b",
        architecture="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
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


WORD_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)
"""The saved random models' chat template: each message as its role and content words."""


def word_tokenizer(
    vocab_size: int, eos_token_id: int | None = None, chat_template: str | None = None
) -> Tokenizer:
    """A word-level tokenizer whose token ``i`` is the word ``t{i}`` (unknown words: ``t0``);
    ``eos_token_id``: the word that ends generation, if any."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    eos = None if eos_token_id is None else f"t{eos_token_id}"
    return Tokenizer(backend, eos_token=eos, chat_template=chat_template)


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


def hf_config(config: ModelArchConfig) -> dict[str, object]:
    """``config`` as an HF ``config.json`` (``LlamaForCausalLM``) that the safetensors loader
    reads back to the same shape."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": "silu",
        "eos_token_id": list(config.eos_token_ids),
        "torch_dtype": "bfloat16",
    }


def save_random_model(
    shape: str, folder: str | Path, seed: int = 0, max_model_len: int | None = None
) -> Path:
    """Write the ``SHAPES[shape]`` checkpoint of ``seed`` (bf16 weights) with its word
    tokenizer and ``WORD_CHAT_TEMPLATE`` as an HF folder; ``max_model_len`` caps its context.
    The folder's name is the model's name (``common/model_files.py:model_name_of``)."""
    config = SHAPES[shape]
    if max_model_len is not None:
        config = replace(config, max_position_embeddings=max_model_len)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    checkpoint = random_checkpoint(config, torch.bfloat16, seed=seed)
    weights = {name: tensor.contiguous() for name, tensor in checkpoint.weights.items()}
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(hf_config(config), indent=2) + "\n")
    eos = config.eos_token_ids[0] if config.eos_token_ids else None
    word_tokenizer(config.vocab_size, eos, WORD_CHAT_TEMPLATE).save(folder)
    return folder


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m splitserve.engine.random_checkpoint",
        description="write a checkpoint of random weights in a named shape as an HF folder",
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--out", type=Path, required=True, help="the folder to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=None, help="cap the context")
    args = parser.parse_args(argv)
    folder = save_random_model(args.shape, args.out, args.seed, args.max_model_len)
    print(f"wrote {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
