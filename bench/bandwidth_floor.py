"""The bandwidth floor: the decode TPOT one stream cannot beat on this machine.

Measures the bytes of weights one decode step reads (every weight matrix of the decoder layers
plus the LM head matrix once, tied or not; the embedding lookup reads one row) and the read
bandwidth of ``.sum()`` over a 1 GiB float32 tensor (median of 5). The floor is the former
divided by the best of the bandwidth measurements.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
from timing_stats import Json

BANDWIDTH_BYTES = 1 << 30
BANDWIDTH_REPEATS = 5


def weight_read_bytes(weights: dict[str, torch.Tensor], tied: bool) -> Json:
    """Bytes of weight matrices one decode step reads: decoder layer matrices + LM head once."""
    layer_bytes = sum(
        t.numel() * t.element_size()
        for name, t in weights.items()
        if name.startswith("model.layers.") and t.dim() == 2
    )
    head = weights["model.embed_tokens.weight" if tied else "lm_head.weight"]
    head_bytes = head.numel() * head.element_size()
    return {
        "decoder_layer_matrix_bytes": layer_bytes,
        "lm_head_bytes": head_bytes,
        "bytes_per_decode_step": layer_bytes + head_bytes,
        "weight_dtype": str(head.dtype).removeprefix("torch."),
    }


def read_bandwidth_gbps() -> float:
    """Read bandwidth of ``.sum()`` over a 1 GiB float32 tensor, median of 5, in GB/s."""
    data = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32)
    data.sum()  # warm-up
    seconds = []
    for _ in range(BANDWIDTH_REPEATS):
        start = time.perf_counter()
        data.sum()
        seconds.append(time.perf_counter() - start)
    return BANDWIDTH_BYTES / statistics.median(seconds) / 1e9


def floor_of(weights: Json, bandwidths_gbps: Sequence[float]) -> Json:
    """The floor uses the best of the measurements: contention only lowers bandwidth."""
    bandwidth = max(bandwidths_gbps)
    floor_ms = weights["bytes_per_decode_step"] / (bandwidth * 1e9) * 1e3
    return weights | {
        "read_bandwidth_gbps": round(bandwidth, 2),
        "read_bandwidth_gbps_at_start_and_end": [round(b, 2) for b in bandwidths_gbps],
        "bandwidth_method": "torch.sum over a 1 GiB float32 tensor, median of 5, "
        "measured at the start and the end of the bench; the higher one is used",
        "floor_tpot_ms": round(floor_ms, 3),
    }
