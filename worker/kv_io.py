"""Reading and writing one request's KV of one layer in an engine's paged cache, as the
transfer layer's contiguous unit ``[2, num_blocks, block_size, kv_heads, head_dim]``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from splitserve.engine.engine_core import EngineCore
from splitserve.transfer.layer_channel import ScatterFn
from splitserve.transfer.layout import KvLayout

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def kv_layout_of(core: EngineCore) -> KvLayout:
    """The layout peers must share with this engine to exchange KV."""
    config = core.model_config
    return KvLayout(
        model=config.name,
        dtype=_DTYPE_NAMES[core.runner.kv_cache.dtype],
        block_size=core.config.cache.block_size,
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
    )


def gather_layer(core: EngineCore, layer: int, block_ids: Sequence[int]) -> torch.Tensor:
    """A contiguous copy of ``layer``'s K and V in these blocks (engine thread)."""
    return core.runner.read_kv_blocks(layer, block_ids)  # [2, blocks, block, kv_heads, dim]


def scatter_into(core: EngineCore, block_ids: Sequence[int]) -> ScatterFn:
    """A scatter function storing received layers into ``block_ids`` (the reserved blocks).

    Safe off the engine thread: reserved blocks are not read or written by the engine until
    the request's remote prefill completes.
    """
    cache = core.runner.kv_cache  # [layers, 2, blocks, block, kv_heads, dim]
    shape = (2, len(block_ids), *cache.shape[3:])
    dtype = cache.dtype

    def scatter(layer: int, data: torch.Tensor) -> None:
        core.runner.write_kv_blocks(layer, block_ids, data.view(dtype).view(shape))

    return scatter
