"""Attention over a paged KV cache: the backend interface and the torch reference backend.

A step's packed batch holds ``num_decode`` single-token sequences first (tokens
``[0, num_decode)``) and then the multi-token sequences (prefill chunks), each a contiguous
span of the packed tokens. Every sequence's query tokens sit at the end of its context: query
``i`` of a sequence with ``query_len`` tokens and ``context_len`` cached-plus-new tokens is at
position ``context_len - query_len + i`` and attends keys ``0..that position``.

Cache layout, one tensor per worker: ``[layers, 2 (k, v), num_blocks, block_size, kv_heads,
head_dim]``. A layer's key cache is ``kv[layer, 0]``; slot ``s`` is block ``s // block_size``,
offset ``s % block_size``. Whole blocks of one layer are contiguous, so a request's KV for a
layer can be gathered or scattered by block id (what the KV transfer needs).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from splitserve.common.blocks import blocks_for_tokens


@dataclass(frozen=True)
class SequenceSpan:
    """Python-side description of one sequence in the step (input to ``prepare``)."""

    query_len: int
    context_len: int
    """Tokens in the cache after this step's tokens are written (>= query_len)."""
    block_table: Sequence[int]

    def new_slots(self, block_size: int) -> list[int]:
        """The cache slot of each of this step's tokens (the last ``query_len`` positions):
        position ``p`` is block ``block_table[p // block_size]``, offset ``p % block_size``."""
        table = self.block_table
        return [
            table[pos // block_size] * block_size + pos % block_size
            for pos in range(self.context_len - self.query_len, self.context_len)
        ]


@dataclass
class TorchAttentionMetadata:
    """Tensors the torch backend needs, built once per step and shared by all layers."""

    slot_mapping: torch.Tensor  # [tokens] int64: cache slot of each new token
    num_decode: int
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks] int64
    decode_context_lens: torch.Tensor  # [num_decode] int64
    decode_mask: torch.Tensor  # [num_decode, 1, 1, max_blocks * block_size] bool
    prefill_spans: list[tuple[int, int, int, torch.Tensor]]
    """(query_start, query_len, context_len, block_ids [blocks] int64) per multi-token seq."""


class AttentionBackend(abc.ABC):
    """Computes attention for one layer and writes the new KV into the paged cache."""

    name: str
    captures_graphs: bool = False
    """Whether ``graph_decode_metadata`` builds metadata a CUDA graph can capture
    (``engine/decode_graphs.py``)."""

    def graph_decode_metadata(
        self,
        slot_mapping: torch.Tensor,  # [rows] int64, -1 for a padding row
        block_tables: torch.Tensor,  # [rows, max_blocks] int32
        seq_lens: torch.Tensor,  # [rows], 0 for a padding row
        block_size: int,
    ) -> object:
        """Metadata of a decode-only batch over fixed buffers whose launches do not depend on
        the buffers' values (where ``captures_graphs``)."""
        raise NotImplementedError(f"the {self.name} backend does not capture graphs")

    @abc.abstractmethod
    def prepare(
        self, spans: Sequence[SequenceSpan], num_decode: int, block_size: int, device: torch.device
    ) -> object:
        """Build the per-step metadata; ``spans[:num_decode]`` have ``query_len == 1``."""

    @abc.abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [tokens, heads, head_dim]
        key: torch.Tensor,  # [tokens, kv_heads, head_dim]
        value: torch.Tensor,  # [tokens, kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        metadata: object,
        scale: float,
    ) -> torch.Tensor:
        """Write ``key``/``value`` into the cache, return attention output [tokens, heads*dim]."""


class TorchAttentionBackend(AttentionBackend):
    """Reference backend: gathers each sequence's blocks and calls torch SDPA.

    With ``batch_invariant`` every sequence, decodes included, is attended on its own over its
    exact context length (no padding to the longest sequence, no mask for a single query), so
    a request's float32 result is independent of the batch around it and matches a
    single-sequence HF run. Otherwise decodes are batched into one padded, masked SDPA call.
    """

    name = "torch"

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant
        # Reused gather buffers: a fresh multi-MiB tensor per layer costs page faults that
        # measured 3-5x the copy itself at batch 64.
        self._gather_buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def _decode_buffers(
        self, key_cache: torch.Tensor, num_rows: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Two ``[num_rows, block_size, kv_heads, dim]`` scratch tensors shaped like the cache."""
        buffers = self._gather_buffers
        row_shape = key_cache.shape[1:]
        if (
            buffers is None
            or buffers[0].shape[0] < num_rows
            or buffers[0].shape[1:] != row_shape
            or buffers[0].dtype != key_cache.dtype
            or buffers[0].device != key_cache.device
        ):
            shape = (num_rows, *row_shape)
            buffers = (key_cache.new_empty(shape), key_cache.new_empty(shape))
            self._gather_buffers = buffers
        return buffers[0][:num_rows], buffers[1][:num_rows]

    def prepare(
        self, spans: Sequence[SequenceSpan], num_decode: int, block_size: int, device: torch.device
    ) -> TorchAttentionMetadata:
        if self.batch_invariant:
            num_decode = 0
        slots = [slot for span in spans for slot in span.new_slots(block_size)]
        decode_spans = spans[:num_decode]
        max_blocks = max(
            (blocks_for_tokens(s.context_len, block_size) for s in decode_spans), default=0
        )
        tables = [list(s.block_table[:max_blocks]) for s in decode_spans]
        tables = [t + [0] * (max_blocks - len(t)) for t in tables]
        lens = torch.tensor([s.context_len for s in decode_spans], dtype=torch.int64)
        key_positions = torch.arange(max_blocks * block_size)
        mask = (key_positions[None, :] < lens[:, None]).view(num_decode, 1, 1, len(key_positions))
        prefill_spans = []
        query_start = num_decode
        for span in spans[num_decode:]:
            needed = blocks_for_tokens(span.context_len, block_size)
            block_ids = torch.tensor(span.block_table[:needed], dtype=torch.int64, device=device)
            prefill_spans.append((query_start, span.query_len, span.context_len, block_ids))
            query_start += span.query_len
        return TorchAttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            num_decode=num_decode,
            decode_block_tables=torch.tensor(tables, dtype=torch.int64, device=device).view(
                num_decode, max_blocks
            ),
            decode_context_lens=lens.to(device),
            decode_mask=mask.to(device),
            prefill_spans=prefill_spans,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: object,
        scale: float,
    ) -> torch.Tensor:
        assert isinstance(metadata, TorchAttentionMetadata)
        num_tokens, num_heads, head_dim = query.shape
        write_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
        output = query.new_empty(num_tokens, num_heads, head_dim)
        if metadata.num_decode:
            decodes = output[: metadata.num_decode]
            self._decode(decodes, query, key_cache, value_cache, metadata, scale)
        for start, query_len, context_len, block_ids in metadata.prefill_spans:
            end = start + query_len
            if context_len == query_len:  # no cached prefix: attend the fresh keys directly
                seq_key, seq_value = key[start:end], value[start:end]
            else:
                seq_key = gather_blocks(key_cache, block_ids)[:context_len]
                seq_value = gather_blocks(value_cache, block_ids)[:context_len]
            output[start:end] = self._prefill(query[start:end], seq_key, seq_value, scale)
        return output.view(num_tokens, num_heads * head_dim)

    def _prefill(
        self,
        query: torch.Tensor,  # [query_len, heads, head_dim]
        key: torch.Tensor,  # [context_len, kv_heads, head_dim]
        value: torch.Tensor,  # [context_len, kv_heads, head_dim]
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of one multi-token sequence; ``[query_len, heads, head_dim]``."""
        return prefill_attention(query, key, value, scale)

    def _decode(
        self,
        out: torch.Tensor,  # [num_decode, heads, head_dim], written
        query: torch.Tensor,  # [tokens, heads, head_dim]; the decodes are its first rows
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        scale: float,
    ) -> None:
        """Attention of the step's single-token sequences (one padded, masked SDPA call)."""
        tables = metadata.decode_block_tables
        out.copy_(
            decode_attention(
                query[: metadata.num_decode],
                key_cache,
                value_cache,
                tables,
                metadata.decode_mask,
                scale,
                self._decode_buffers(key_cache, tables.numel()),
            )
        )


def write_kv(
    key: torch.Tensor,  # [tokens, kv_heads, head_dim]
    value: torch.Tensor,  # [tokens, kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [tokens] int64
) -> None:
    """Store each token's key and value in its cache slot."""
    kv_heads, head_dim = key.shape[1], key.shape[2]
    key_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Concatenate ``[blocks, block_size, kv_heads, dim]`` into ``[tokens, kv_heads, dim]``."""
    gathered = cache.index_select(0, block_ids)  # [blocks, block_size, kv_heads, dim]
    return gathered.flatten(0, 1)


def decode_attention(
    query: torch.Tensor,  # [batch, heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks] int64
    mask: torch.Tensor,  # [batch, 1, 1, max_blocks * block_size] bool
    scale: float,
    gather_out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One query token per sequence over its paged context; returns ``[batch, heads, head_dim]``.

    ``gather_out``, if given, receives the gathered key and value blocks
    (``[batch * max_blocks, block_size, kv_heads, dim]`` each) instead of fresh tensors.

    GQA without copying KV per query head: the ``group`` query heads that share a KV head are
    the query rows of that KV head (measured here at batch 64: 3x faster than SDPA's
    ``enable_gqa``, which runs one single-row problem per query head).
    """
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    flat_tables = block_tables.flatten()  # [batch * max_blocks]
    kv_shape = (batch, -1, num_kv_heads, head_dim)
    key_out, value_out = gather_out if gather_out is not None else (None, None)
    keys = torch.index_select(key_cache, 0, flat_tables, out=key_out)
    values = torch.index_select(value_cache, 0, flat_tables, out=value_out)
    keys = keys.view(kv_shape).transpose(1, 2)  # [batch, kv_heads, max_blocks * block_size, dim]
    values = values.view(kv_shape).transpose(1, 2)
    grouped_query = query.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped_query, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def prefill_attention(
    query: torch.Tensor,  # [query_len, heads, head_dim]
    key: torch.Tensor,  # [context_len, kv_heads, head_dim]
    value: torch.Tensor,  # [context_len, kv_heads, head_dim]
    scale: float,
) -> torch.Tensor:
    """Causal attention of the last ``query_len`` positions of a context.

    Returns ``[query_len, heads, dim]``.
    """
    query_len = query.shape[0]
    context_len = key.shape[0]
    q = query.transpose(0, 1).unsqueeze(0)  # [1, heads, query_len, dim]
    k = key.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, context_len, dim]
    v = value.transpose(0, 1).unsqueeze(0)
    if context_len == query_len or query_len == 1:  # causal from the top left, or all keys
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=query_len > 1, scale=scale, enable_gqa=True
        )
    else:
        offset = context_len - query_len
        rows = torch.arange(query_len, device=query.device)[:, None] + offset
        mask = torch.arange(context_len, device=query.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )  # [1, heads, query_len, dim]
    return out[0].transpose(0, 1)
