"""The CPU attention backend: the torch backend with decodes on the C++ paged kernel.

Decodes read their KV blocks in place (``cpu_attention.CpuDecodeAttention``) instead of
gathering every sequence's blocks into a padded copy for one masked SDPA call; bf16 prefill
chunks run the C++ causal kernel (``CpuPrefillAttention``, AVX-512 BF16) when there is one,
torch SDPA otherwise. The kernel computes each sequence on its own, so decodes are batch
invariant without running them one by one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from splitserve.kernels.attention import SequenceSpan, TorchAttentionBackend, TorchAttentionMetadata
from splitserve.kernels.cpu_attention import CpuDecodeAttention, CpuPrefillAttention


class CpuAttentionBackend(TorchAttentionBackend):
    """``TorchAttentionBackend`` whose decode attention runs ``CpuDecodeAttention``."""

    name = "cpu"

    def __init__(
        self,
        kernel: CpuDecodeAttention,
        num_blocks: int,
        prefill_kernel: CpuPrefillAttention | None = None,
    ) -> None:
        """``num_blocks``: blocks in the KV cache this backend will read (block ids of every
        step's tables are checked against it once per step, not once per layer).
        ``prefill_kernel``: bf16 prefill chunks run on it when given (else torch SDPA)."""
        super().__init__(batch_invariant=False)  # the kernel is batch invariant by itself
        self._kernel = kernel
        self._prefill_kernel = prefill_kernel
        self._num_blocks = num_blocks

    @property
    def decode_kernel(self) -> CpuDecodeAttention:
        """The kernel decodes run on."""
        return self._kernel

    def tables_checked(self, key_cache: torch.Tensor) -> bool:
        """Whether ``prepare`` checked a step's tables against this cache's blocks."""
        return key_cache.shape[0] == self._num_blocks

    def prepare(
        self, spans: Sequence[SequenceSpan], num_decode: int, block_size: int, device: torch.device
    ) -> TorchAttentionMetadata:
        metadata = super().prepare(spans, num_decode, block_size, device)
        if metadata.num_decode:
            CpuDecodeAttention.check_tables(
                metadata.decode_block_tables,
                metadata.decode_context_lens,
                self._num_blocks,
                block_size,
            )
        return metadata

    def _decode(
        self,
        out: torch.Tensor,  # [num_decode, heads, head_dim], written
        query: torch.Tensor,  # [tokens, heads, head_dim]; the decodes are its first rows
        key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        value_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        scale: float,
    ) -> None:
        self._kernel(
            out,
            query[: metadata.num_decode],
            key_cache,
            value_cache,
            metadata.decode_block_tables,
            metadata.decode_context_lens,
            scale,
            tables_checked=self.tables_checked(key_cache),
        )

    def _prefill(
        self,
        query: torch.Tensor,  # [query_len, heads, head_dim]
        key: torch.Tensor,  # [context_len, kv_heads, head_dim]
        value: torch.Tensor,  # [context_len, kv_heads, head_dim]
        scale: float,
    ) -> torch.Tensor:
        kernel = self._prefill_kernel
        if kernel is not None and kernel.supports(query, key):
            return kernel(query, key, value, scale)
        return super()._prefill(query, key, value, scale)
