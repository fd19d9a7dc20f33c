"""Checkpoints of random weights in a named shape, for benchmarks and device tests.

A machine that cannot hold or fetch a real checkpoint (the lent GPU machines carry at most
64 MiB; Llama-8B is 16 GB) still runs the real model code at the real shape: every weight of
``expected_weight_shapes`` is drawn from a normal distribution (norm weights are ones), on the
device asked for, from one seed. The same seed, shape and dtype give the same weights on every
device when drawn on the CPU (``device="cpu"``; move them after), so a CPU engine and a CUDA
engine can be compared on identical weights. The shapes (``SHAPES``: ``llama-8b``,
``llama-1b``, ``tiny``) and the word tokenizer live in ``engine/random_shapes.py`` (torch-free)
and are re-exported here.

Two ways to serve one without fetching anything:

- ``--model random:SHAPE[:SEED]`` (``engine/random_shapes.py:RandomModelSpec``): nothing on
  disk; each worker draws the weights at its start on its own device
  (``random_model_checkpoint``; Llama-8B's 16 GB in about a second on a GPU);
- ``save_random_model`` writes the checkpoint as an HF folder (``config.json``,
  ``model.safetensors``, ``tokenizer.json`` with a plain chat template) that every role loads
  like any other model (``--model DIR``): e.g. a second, differently shaped model for a
  cluster that serves several (``splitserve up --extra-model DIR``)::

    python -m splitserve.engine.random_checkpoint --shape tiny --out /tmp/random-tiny
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from splitserve.engine.loaded_checkpoint import LoadedCheckpoint, expected_weight_shapes
from splitserve.engine.model_config import ModelArchConfig
from splitserve.engine.random_shapes import (
    SHAPES,
    WORD_CHAT_TEMPLATE,
    RandomModelSpec,
    word_tokenizer,
)

__all__ = [
    "SHAPES",
    "WORD_CHAT_TEMPLATE",
    "hf_config",
    "random_checkpoint",
    "random_model_checkpoint",
    "save_random_model",
    "word_tokenizer",
]

STORED_DTYPE = torch.bfloat16
"""The dtype a random model's weights are drawn in, as a checkpoint stores them: the same
weights whatever dtype an engine then computes in (``random_model_checkpoint``)."""


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


def random_model_checkpoint(
    spec: RandomModelSpec, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> LoadedCheckpoint:
    """The model ``spec`` names, drawn on ``device`` as a ``STORED_DTYPE`` checkpoint and cast
    to ``dtype``, with the spec's tokenizer (``RandomModelSpec.tokenizer``). On the CPU its
    weights equal those ``save_random_model(spec.shape, DIR, seed=spec.seed)`` writes, loaded
    in ``dtype``; a CUDA device draws its own (the same for every run on CUDA)."""
    drawn = random_checkpoint(spec.config, STORED_DTYPE, device, seed=spec.seed)
    weights = {name: tensor.to(dtype) for name, tensor in drawn.weights.items()}
    return LoadedCheckpoint(config=spec.config, weights=weights, tokenizer=spec.tokenizer())


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
    checkpoint = random_checkpoint(config, STORED_DTYPE, seed=seed)
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
