"""Rotary position embedding (RoPE) in the HF "rotate half" layout.

The cos/sin table is computed once in float32 for every position of the context window and
stored in the model dtype (as HF does); ``apply_rotary`` rotates queries and keys of a packed
batch in one call.
"""

from __future__ import annotations

import math

import torch

from splitserve.engine.model_config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Per-pair rotation frequencies, scaled as the checkpoint asks."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)  # [head_dim / 2]
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by ``factor``, short kept, smooth between."""
    original = scaling.original_max_position_embeddings
    low_freq_wavelen = original / scaling.low_freq_factor
    high_freq_wavelen = original / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (original / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin_table(
    head_dim: int,
    theta: float,
    scaling: RopeScaling,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables ``cos, sin`` of shape ``[max_positions, head_dim]`` (halves repeated)."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling)
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    angles = torch.outer(positions, inv_freq)  # [positions, head_dim / 2]
    angles = torch.cat((angles, angles), dim=-1)  # [positions, head_dim]
    return angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[tokens, heads, head_dim]`` by per-token ``cos``/``sin`` ``[tokens, dim]``.

    Returns a new contiguous tensor; ``x`` may be a strided view (e.g. of a fused qkv output).
    """
    half = x.shape[-1] // 2
    cos = cos.unsqueeze(1)  # [tokens, 1, head_dim]
    sin = sin.unsqueeze(1)
    x1 = x[..., :half]
    x2 = x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)  # [tokens, heads, head_dim]
    return x * cos + rotated * sin
