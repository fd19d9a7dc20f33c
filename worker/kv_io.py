"""Where one request's KV comes from in an engine's paged cache ``[layers, 2, blocks,
block_size, kv_heads, head_dim]``, in the order a ``TransferPlan`` says; where it lands is
``transfer/destination.py:KvDestination``.

The cache is the engine's ``PagedKv`` (``AsyncEngine.paged_kv``), under its threading
contract: ``gather_layer`` runs on the engine thread (the layer hook), and receives land only
in blocks of a remote-prefill reservation, which no step touches until its prefill completes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from splitserve.common.kv_layout import KvLayout
from splitserve.engine.engine_face import EngineFacts, PagedKv
from splitserve.engine.host_memory import empty_huge_pages
from splitserve.transfer.plan import TransferPlan

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def kv_layout_of(facts: EngineFacts, kv: PagedKv) -> KvLayout:
    """The layout peers must share with this engine (its facts, its cache) to exchange KV."""
    return KvLayout(
        model=facts.model_name,
        dtype=_DTYPE_NAMES[kv.dtype],
        block_size=kv.block_size,
        num_layers=kv.num_layers,
        num_kv_heads=kv.num_kv_heads,
        head_dim=kv.head_dim,
    )


def staging_buffer(kv: PagedKv, num_blocks: int) -> torch.Tensor:
    """Uninitialized room for one request's KV of every layer, ``[layers, 2, num_blocks,
    block, kv_heads, dim]``, for ``gather_layer`` to fill; on CPU backed by huge pages, which
    UCX copies out of markedly faster than 4 KiB pages (see ``engine.host_memory``)."""
    cache = kv.cache  # [layers, 2, blocks, block, kv_heads, dim]
    shape = (cache.shape[0], 2, num_blocks, *cache.shape[3:])
    return empty_huge_pages(shape, cache.dtype, cache.device)


def gather_layer(
    kv: PagedKv,
    layer: int,
    block_ids: Sequence[int],
    plan: TransferPlan,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """A contiguous copy of ``layer``'s K and V in these blocks (the prompt's, in block-table
    order), reordered as ``plan.block_order`` says: ``[2, blocks, block, kv_heads, dim]``,
    written into ``out`` (e.g. ``staging_buffer(...)[layer]``) when given. On the engine
    thread, or for held full cached blocks where ``PagedKv.reads_held_blocks_anywhere``."""
    return kv.read_blocks(layer, [block_ids[position] for position in plan.block_order], out)
