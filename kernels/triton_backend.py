"""The Triton attention backend: the engine's ``AttentionBackend`` on the paged-cache kernels.

Per layer: ``store_kv`` writes the step's new keys/values (decodes and prefill chunks) into
their slots, ``paged_decode_attention`` (GQA-grouped, split-K) computes the ``num_decode``
single-token sequences at the front of the packed batch, and ``context_attention`` the prefill
chunks after them, reading cached prefixes straight from the paged cache. All per-step index
tensors are built once in ``prepare`` and shared by every layer; ``forward`` never syncs.

With ``batch_invariant`` the decode kernel runs unsplit and with a fixed key tile
(``INVARIANT_DECODE_BLOCK_N``), so a sequence's result does not depend on the batch around it
(the split count and tile otherwise follow batch size and the longest context).

CUDA graphs (``engine/decode_graphs.py``) take ``graph_decode_metadata``: the same fields over
fixed buffers, with the tables' whole width as the longest context, so a captured step's grid
and split length never depend on the contexts a replay sees.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitserve.common.blocks import blocks_for_tokens
from splitserve.kernels.attention import AttentionBackend, SequenceSpan
from splitserve.kernels.decode_attention import paged_decode_attention
from splitserve.kernels.prefill_attention import context_attention
from splitserve.kernels.store_kv import store_kv
from splitserve.kernels.triton_utils import require_triton

INVARIANT_DECODE_BLOCK_N = 64
"""Keys per loop step of the batch-invariant decode kernel: fixed, where the default follows
the batch's longest context (its split length)."""


@dataclass
class TritonAttentionMetadata:
    """Tensors the Triton backend needs, built once per step and shared by all layers."""

    slot_mapping: torch.Tensor  # [tokens] int64: cache slot of each new token
    num_decode: int
    decode_block_tables: torch.Tensor  # [num_decode, max_decode_blocks] int32, 0-padded
    decode_seq_lens: torch.Tensor  # [num_decode] int32: context length of each decode
    decode_max_seq_len: int
    decode_num_splits: int | None
    """Split-K ranges per decode sequence; None: ``default_num_splits`` (same for every layer)."""
    decode_block_n: int | None
    """Keys per loop step of the decode kernel; None: chosen from the split length."""
    prefill_block_tables: torch.Tensor  # [num_prefill, max_prefill_blocks] int32, 0-padded
    prefill_query_start: torch.Tensor  # [num_prefill + 1] int32, offsets after the decodes
    prefill_context_lens: torch.Tensor  # [num_prefill] int32
    prefill_max_query_len: int


def padded_tables(
    spans: Sequence[SequenceSpan], block_size: int, device: torch.device
) -> torch.Tensor:
    """Block tables cut to each context and 0-padded: ``[len(spans), max_blocks]`` int32."""
    tables = [list(s.block_table[: blocks_for_tokens(s.context_len, block_size)]) for s in spans]
    width = max((len(table) for table in tables), default=0)
    rows = [table + [0] * (width - len(table)) for table in tables]
    return torch.tensor(rows, dtype=torch.int32).view(len(spans), width).to(device)


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with Triton kernels (CUDA, or CPU under Triton's interpreter)."""

    name = "triton"
    captures_graphs = True

    def __init__(self, batch_invariant: bool = False) -> None:
        require_triton()
        self.batch_invariant = batch_invariant

    def prepare(
        self, spans: Sequence[SequenceSpan], num_decode: int, block_size: int, device: torch.device
    ) -> TritonAttentionMetadata:
        slots = [slot for span in spans for slot in span.new_slots(block_size)]
        decodes, prefills = spans[:num_decode], spans[num_decode:]
        decode_lens = [s.context_len for s in decodes]
        query_start = [0]
        for span in prefills:
            query_start.append(query_start[-1] + span.query_len)
        device = torch.device(device)

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32).to(device)

        return TritonAttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device),
            num_decode=num_decode,
            decode_block_tables=padded_tables(decodes, block_size, device),
            decode_seq_lens=ints(decode_lens),
            decode_max_seq_len=max(decode_lens, default=0),
            decode_num_splits=1 if self.batch_invariant else None,
            decode_block_n=INVARIANT_DECODE_BLOCK_N if self.batch_invariant else None,
            prefill_block_tables=padded_tables(prefills, block_size, device),
            prefill_query_start=ints(query_start),
            prefill_context_lens=ints([s.context_len for s in prefills]),
            prefill_max_query_len=max((s.query_len for s in prefills), default=0),
        )

    def graph_decode_metadata(
        self,
        slot_mapping: torch.Tensor,  # [rows] int64, -1 for a padding row
        block_tables: torch.Tensor,  # [rows, max_blocks] int32
        seq_lens: torch.Tensor,  # [rows] int32/int64, 0 for a padding row
        block_size: int,
    ) -> TritonAttentionMetadata:
        """Metadata of a decode-only batch of ``rows`` over fixed buffers (a CUDA graph's
        inputs): every row one decode, the tables' whole width ``max_blocks * block_size`` as
        the longest context. The split count then follows the batch size and that capacity
        only (one split where ``batch_invariant``), so whatever the buffers hold at a replay
        (contexts up to the capacity), the captured launches compute it; a row of length 0
        stores nothing and attends to nothing. Nothing here reads the buffers' values."""
        device = seq_lens.device
        empty_tables = torch.zeros(0, 0, dtype=torch.int32, device=device)
        return TritonAttentionMetadata(
            slot_mapping=slot_mapping,
            num_decode=seq_lens.shape[0],
            decode_block_tables=block_tables,
            decode_seq_lens=seq_lens,
            decode_max_seq_len=block_tables.shape[1] * block_size,
            decode_num_splits=1 if self.batch_invariant else None,
            decode_block_n=INVARIANT_DECODE_BLOCK_N if self.batch_invariant else None,
            prefill_block_tables=empty_tables,
            prefill_query_start=torch.zeros(1, dtype=torch.int32, device=device),
            prefill_context_lens=torch.zeros(0, dtype=torch.int32, device=device),
            prefill_max_query_len=0,
        )

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
        assert isinstance(metadata, TritonAttentionMetadata)
        num_tokens, num_heads, head_dim = query.shape
        store_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
        output = query.new_empty(num_tokens, num_heads, head_dim)  # [tokens, heads, head_dim]
        decodes = metadata.num_decode
        if decodes:
            paged_decode_attention(
                query[:decodes],
                key_cache,
                value_cache,
                metadata.decode_block_tables,
                metadata.decode_seq_lens,
                scale,
                max_seq_len=metadata.decode_max_seq_len,
                num_splits=metadata.decode_num_splits,
                block_n=metadata.decode_block_n,
                out=output[:decodes],
            )
        if num_tokens > decodes:
            context_attention(
                query[decodes:],
                key_cache,
                value_cache,
                metadata.prefill_block_tables,
                metadata.prefill_query_start,
                metadata.prefill_context_lens,
                scale,
                max_query_len=metadata.prefill_max_query_len,
                out=output[decodes:],
            )
        return output.view(num_tokens, num_heads * head_dim)
