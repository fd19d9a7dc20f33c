"""What a checkpoint loader returns, and the check every loader applies to its weights.

``engine/checkpoint.py`` picks a loader (``engine/gguf_loader.py``,
``engine/safetensors_loader.py``); the loaders build a ``LoadedCheckpoint`` here and check it
with ``check_weights``, so they import this module only and never the dispatcher.

Weight names (``expected_weight_shapes``) are HF Llama's: ``model.embed_tokens.weight``,
``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`` (+ q/k/v ``.bias`` with
``attention_bias``), ``model.layers.{i}.mlp.{gate,up,down}_proj.weight``,
``model.layers.{i}.{input,post_attention}_layernorm.weight``, ``model.norm.weight`` and
``lm_head.weight`` only when the embeddings are not tied. Q/K rows are in HF order (the two
rotary halves of each head contiguous, as ``rotate_half`` expects).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from splitserve.common.errors import ModelLoadError
from splitserve.common.tokenizer import Tokenizer
from splitserve.engine.model_config import ModelArchConfig

_MAX_LISTED_NAMES = 8


@dataclass(frozen=True)
class LoadedCheckpoint:
    """Everything a worker needs to run a model."""

    config: ModelArchConfig
    weights: dict[str, torch.Tensor]
    """HF tensor name -> tensor in the requested dtype (see the module docstring)."""
    tokenizer: Tokenizer
    quantized: dict[str, QuantizedTensor] = field(default_factory=dict)
    """HF name -> the GGUF blocks of a quantized 2-d weight as the file stores them (rows in
    HF order, like ``weights``); only where ``load_checkpoint`` was asked to keep them."""


@dataclass(frozen=True)
class QuantizedTensor:
    """A 2-d weight's quantized blocks: ``blocks`` ``[out, in / block_size * block_bytes]``
    uint8, row ``o`` holding output ``o``'s blocks in input order; ``ggml_type`` the GGUF
    type id (``type_name`` its name); ``out_features, in_features`` the weight's shape."""

    blocks: torch.Tensor
    ggml_type: int
    type_name: str
    out_features: int
    in_features: int

    @staticmethod
    def stacked(parts: list[QuantizedTensor | None]) -> QuantizedTensor | None:
        """The parts' rows one after another (a fused projection such as q/k/v), None when a
        part is missing or the parts differ in type or input width."""
        first = parts[0]
        if first is None or any(
            part is None
            or part.ggml_type != first.ggml_type
            or part.in_features != first.in_features
            for part in parts
        ):
            return None
        present = [part for part in parts if part is not None]
        return QuantizedTensor(
            blocks=torch.cat([part.blocks for part in present]),
            ggml_type=first.ggml_type,
            type_name=first.type_name,
            out_features=sum(part.out_features for part in present),
            in_features=first.in_features,
        )


def expected_weight_shapes(config: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor a checkpoint of ``config`` must provide."""
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    projections = {
        "self_attn.q_proj": (config.q_size, hidden),
        "self_attn.k_proj": (config.kv_size, hidden),
        "self_attn.v_proj": (config.kv_size, hidden),
        "self_attn.o_proj": (hidden, config.q_size),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        for name, shape in projections.items():
            shapes[f"{prefix}{name}.weight"] = shape
        for name in ("q_proj", "k_proj", "v_proj") if config.attention_bias else ():
            rows = shapes[f"{prefix}self_attn.{name}.weight"][0]
            shapes[f"{prefix}self_attn.{name}.bias"] = (rows,)
        shapes[f"{prefix}input_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}post_attention_layernorm.weight"] = (hidden,)
    return shapes


def check_weights(config: ModelArchConfig, weights: dict[str, torch.Tensor], source: Path) -> None:
    """Raise ``ModelLoadError`` unless ``weights`` has exactly the expected names and shapes."""
    expected = expected_weight_shapes(config)
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ModelLoadError(f"{source}: {len(missing)} tensors missing: {_listing(missing)}")
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise ModelLoadError(
            f"{source}: unexpected tensors (not a plain Llama-family checkpoint?): "
            f"{_listing(unexpected)}"
        )
    wrong = [
        f"{name} is {tuple(weights[name].shape)}, expected {shape}"
        for name, shape in expected.items()
        if tuple(weights[name].shape) != shape
    ]
    if wrong:
        raise ModelLoadError(f"{source}: tensors of the wrong shape: {_listing(wrong)}")


def _listing(items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED_NAMES])
    more = len(items) - _MAX_LISTED_NAMES
    return f"{shown} and {more} more" if more > 0 else shown
