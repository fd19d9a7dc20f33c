"""What code outside ``engine/`` may use of an engine besides its requests and its reports.

A worker's domain objects see their engine through ``AsyncEngine`` only (its requests, its
reports: ``engine_report.py``) and these objects it hands out: ``EngineFacts`` (what the
loaded engine is), ``PagedKv`` (its KV cache, for KV transfer) and the layer hook's
``CompletedPrompt``. None of them leads to the ``EngineCore``, its scheduler or its block
pool; ``tests/test_engine_face.py`` checks that no code outside ``engine/`` reaches those.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from splitserve.common.adapter_id import AdapterId
from splitserve.engine.kv_blocks import KvBlockStore
from splitserve.transfer.paced import LinkModel


@dataclass(frozen=True)
class EngineFacts:
    """What a loaded engine is; fixed for its life, so any thread may read it."""

    model_name: str
    vocab_size: int
    max_model_len: int
    """Tokens one sequence may hold (prompt and output)."""
    num_blocks: int
    """KV blocks in the pool."""
    kv_link: LinkModel | None = None
    """A simulated engine's: the link its KV transfers are paced on, so they take what the
    real model's KV takes (``transfer/paced.py``); None: a real engine, or a profile
    without measured transfer figures."""
    adapters: tuple[AdapterId, ...] = ()
    """The LoRA adapters it loaded at start (``ModelConfig.lora_modules``); those it serves
    now, runtime loads and unloads included: ``AsyncEngine.served_adapters``."""


@dataclass(frozen=True)
class CompletedPrompt:
    """A request whose prompt's KV is complete in this step, layer by layer."""

    request_id: str
    block_table: Sequence[int]
    """The request's blocks in position order (they hold the whole prompt's KV)."""


@dataclass(frozen=True)
class ReservedBlocks:
    """The blocks a remote-prefill reservation holds for a prompt, in position order.

    The first ``num_cached_blocks`` came from this engine's prefix cache and already hold the
    prompt's KV of those positions (full blocks of the same tokens, hash-chained): nobody
    writes them. KV computed elsewhere lands only in the rest, ``block_ids[num_cached_blocks:]``
    (at least one block: the prompt's last token is never taken from the cache)."""

    block_ids: tuple[int, ...]
    num_cached_blocks: int = 0

    @property
    def receiving(self) -> tuple[int, ...]:
        """The blocks KV lands in."""
        return self.block_ids[self.num_cached_blocks :]


@dataclass(frozen=True)
class PulledKv:
    """KV of a prompt's leading full blocks that another worker holds and sent here (the
    reverse transfer): blocks ``first_block .. first_block + num_blocks`` of the prompt, in
    position order. Submitted with the prompt's request (``AsyncEngine.submit``), they enter
    this engine's prefix cache in the same command, after its own cached blocks, so the
    request computes only the tokens after them."""

    first_block: int
    kv: torch.Tensor
    """``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``, the cache's dtype and
    device (``worker/kv_io.py:staging_buffer``)."""

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[2]


LayerHook = Callable[[int, Sequence[CompletedPrompt]], None]
"""Called on the engine thread with (layer index, the prompts this step completes) once that
layer's KV is written; not called in steps that complete no prompt."""


class PagedKv:
    """The engine's paged KV cache as KV transfer sees it.

    Threading contract: the engine thread writes, in every step, the blocks of the requests
    that step runs. Another thread may read or write a block of ``cache`` only while the
    engine keeps that block out of every step and out of the pool: the blocks of a
    remote-prefill reservation, from its grant (``AsyncEngine.submit`` with
    ``reserve_remote_prefill``) until the request's remote prefill completes
    (``AsyncEngine.complete_remote_prefill``); the caller's hold on them keeps them out of
    the pool, also after the request ended, until ``AsyncEngine.release_blocks``. This is
    where a decode worker's KV receives land. ``read_blocks`` runs on the engine thread
    only (the layer hook): the blocks it reads are the ones the step is writing.
    """

    def __init__(self, runner: KvBlockStore) -> None:
        self._runner = runner
        self.cache: torch.Tensor = runner.kv_cache
        """``[layers, 2, blocks, block_size, kv_heads, head_dim]``, contiguous."""

    @property
    def num_layers(self) -> int:
        return self.cache.shape[0]

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.cache.shape[3]

    @property
    def num_kv_heads(self) -> int:
        return self.cache.shape[4]

    @property
    def head_dim(self) -> int:
        return self.cache.shape[5]

    @property
    def dtype(self) -> torch.dtype:
        return self.cache.dtype

    def read_blocks(
        self, layer: int, block_ids: Sequence[int], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """A copy of ``layer``'s K and V in these blocks, ``[2, blocks, block_size, kv_heads,
        head_dim]``, written into ``out`` when given. Engine thread only, except for full
        prefix-cache blocks the caller holds (a reservation's cached prefix: no step writes a
        full cached block, and the hold keeps it from being handed out), which any thread may
        read where ``reads_held_blocks_anywhere``."""
        return self._runner.read_kv_blocks(layer, block_ids, out)

    @property
    def reads_held_blocks_anywhere(self) -> bool:
        """Whether held full blocks may be read off the engine thread (``read_blocks``): a
        cache in host memory (on a GPU the read would race the engine's stream)."""
        return self.cache.device.type == "cpu"
