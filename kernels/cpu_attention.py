"""Decode and causal prefill attention on the CPU through the C++ kernels (``cpu/*.cpp``).

``CpuDecodeAttention`` wraps the compiled library (``cpu_build``) behind a tensor API and
checks every argument the C side trusts (dtypes, shapes, contiguity, context lengths within the
block tables), so a wrong call raises ``ValueError`` instead of reading out of bounds.
``load_cpu_decode_attention`` returns None (logging why) when the library is not installed or
does not load, or when ``SPLITSERVE_CPU_KERNELS=0``; callers then keep the torch path
(``cpu_build.load_library``).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from splitserve.kernels.cpu_build import bind_functions, function_address, load_library

_ARGTYPES = [
    ctypes.c_void_p,  # out
    ctypes.c_void_p,  # query
    ctypes.c_int64,  # query_stride
    ctypes.c_void_p,  # key_cache
    ctypes.c_void_p,  # value_cache
    ctypes.c_void_p,  # block_tables
    ctypes.c_int64,  # table_stride
    ctypes.c_void_p,  # context_lens
    ctypes.c_int64,  # num_seqs
    ctypes.c_int64,  # num_heads
    ctypes.c_int64,  # num_kv_heads
    ctypes.c_int64,  # head_dim
    ctypes.c_int64,  # block_size
    ctypes.c_float,  # scale
    ctypes.c_int,  # num_threads
]
_SYMBOLS = {
    torch.bfloat16: "splitserve_paged_decode_attention_bf16",
    torch.float32: "splitserve_paged_decode_attention_f32",
}


class CpuDecodeAttention:
    """One query token per sequence over its paged context, on the CPU (see the C++ contract).

    ctypes releases the GIL for the call; the kernel uses torch's intra-op thread count.
    """

    def __init__(self, library: ctypes.CDLL) -> None:
        bind_functions(library, {symbol: _ARGTYPES for symbol in _SYMBOLS.values()})
        self._functions = {dtype: getattr(library, symbol) for dtype, symbol in _SYMBOLS.items()}
        self._addresses = {dtype: function_address(f) for dtype, f in self._functions.items()}

    @staticmethod
    def check_tables(
        block_tables: torch.Tensor,  # [seqs, max_blocks] int64
        context_lens: torch.Tensor,  # [seqs] int64
        num_blocks: int,
        block_size: int,
    ) -> None:
        """Raise ``ValueError`` unless the tables are what the kernel may trust: contiguous
        int64, every context in 1..(its table's capacity), every block id in the cache."""
        if (
            block_tables.dtype != torch.int64
            or context_lens.dtype != torch.int64
            or block_tables.dim() != 2
            or not block_tables.is_contiguous()
            or not context_lens.is_contiguous()
            or context_lens.shape != (block_tables.shape[0],)
        ):
            raise ValueError("decode attention: tables must be contiguous int64, one per context")
        if context_lens.numel() == 0:
            return
        if int(context_lens.min()) < 1 or int(context_lens.max()) > (
            block_tables.shape[1] * block_size
        ):
            raise ValueError("decode attention: a context is empty or longer than its block table")
        if block_tables.numel() and not (
            int(block_tables.min()) >= 0 and int(block_tables.max()) < num_blocks
        ):
            raise ValueError("decode attention: block id out of range")

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(self._functions)

    def address(self, dtype: torch.dtype) -> int:
        """The C function for ``dtype``'s rows, as an address (for
        ``kernels/cpu_decode_layers.py``); ``KeyError`` for a dtype it has none for."""
        return self._addresses[dtype]

    def _checked_query(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        tables_checked: bool,
    ) -> torch.Tensor:
        """Raise ``ValueError`` unless ``__call__``'s arguments are what the kernel may trust:
        ``out``, ``query`` and the caches of one dtype and matching shapes (whole KV head
        groups), ``out`` and the caches contiguous, one block table per query row (the
        tables checked unless ``tables_checked``). Returns ``query`` with each row's heads
        contiguous (a copy only where they were not)."""
        num_seqs, num_heads, head_dim = query.shape
        num_blocks, block_size, num_kv_heads, cache_dim = key_cache.shape
        if (
            out.shape != query.shape
            or value_cache.shape != key_cache.shape
            or cache_dim != head_dim
            or {out.dtype, key_cache.dtype, value_cache.dtype} != {query.dtype}
            or num_heads % num_kv_heads
        ):
            raise ValueError("decode attention: mismatched shapes or dtypes")
        if not (out.is_contiguous() and key_cache.is_contiguous() and value_cache.is_contiguous()):
            raise ValueError("decode attention: out and the caches must be contiguous")
        if query.stride(2) != 1 or query.stride(1) != head_dim:
            query = query.contiguous()
        if not tables_checked:
            self.check_tables(block_tables, context_lens, num_blocks, block_size)
        if block_tables.shape[0] != num_seqs:
            raise ValueError("decode attention: one block table per query row")
        return query

    def __call__(
        self,
        out: torch.Tensor,  # [seqs, heads, head_dim]
        query: torch.Tensor,  # [seqs, heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        block_tables: torch.Tensor,  # [seqs, max_blocks] int64
        context_lens: torch.Tensor,  # [seqs] int64
        scale: float,
        tables_checked: bool = False,
    ) -> torch.Tensor:
        """Write attention of each ``query`` row over its context into ``out``; returns it.

        ``tables_checked``: the caller already ran ``check_tables`` on these tables (once per
        step instead of once per layer).
        """
        function = self._functions.get(query.dtype)
        if function is None:
            raise ValueError(f"no CPU decode kernel for {query.dtype}")
        query = self._checked_query(
            out, query, key_cache, value_cache, block_tables, context_lens, tables_checked
        )
        num_seqs, num_heads, head_dim = query.shape
        _num_blocks, block_size, num_kv_heads, _ = key_cache.shape
        if num_seqs == 0:
            return out
        status = function(
            out.data_ptr(),
            query.data_ptr(),
            query.stride(0),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            block_tables.data_ptr(),
            block_tables.shape[1],
            context_lens.data_ptr(),
            num_seqs,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            scale,
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(f"decode attention kernel refused its arguments (code {status})")
        return out


_PREFILL_ARGTYPES = [
    ctypes.c_void_p,  # out
    ctypes.c_void_p,  # query
    ctypes.c_int64,  # query_stride
    ctypes.c_void_p,  # key
    ctypes.c_int64,  # key_stride
    ctypes.c_void_p,  # value
    ctypes.c_int64,  # value_stride
    ctypes.c_int64,  # num_queries
    ctypes.c_int64,  # context
    ctypes.c_int64,  # num_heads
    ctypes.c_int64,  # num_kv_heads
    ctypes.c_int64,  # head_dim
    ctypes.c_float,  # scale
    ctypes.c_int,  # threads
]
PREFILL_UNSUPPORTED = -2
"""What the prefill kernel returns when built without AVX-512 BF16 (callers use torch)."""


def _rows_dense(tensor: torch.Tensor) -> bool:
    """Heads contiguous within a row and head_dim within a head (rows may be strided)."""
    return tensor.stride(2) == 1 and tensor.stride(1) == tensor.shape[2]


class CpuPrefillAttention:
    """Causal bf16 attention of one sequence's query rows over its context (C++ contract in
    ``cpu/prefill_attention.cpp``); needs AVX-512 BF16, see ``available``."""

    def __init__(self, library: ctypes.CDLL) -> None:
        function = library.splitserve_prefill_attention_bf16
        function.argtypes = _PREFILL_ARGTYPES
        function.restype = ctypes.c_int
        self._function = function
        probe = torch.zeros(1, 1, 32, dtype=torch.bfloat16)
        self.available = self._run(probe.clone(), probe, probe, probe, 1.0) != PREFILL_UNSUPPORTED
        """False when this CPU build has no AVX-512 BF16 path."""

    def _run(self, out, query, key, value, scale: float) -> int:
        return self._function(
            out.data_ptr(),
            query.data_ptr(),
            query.stride(0),
            key.data_ptr(),
            key.stride(0),
            value.data_ptr(),
            value.stride(0),
            query.shape[0],
            key.shape[0],
            query.shape[1],
            key.shape[1],
            query.shape[2],
            scale,
            torch.get_num_threads(),
        )

    def supports(self, query: torch.Tensor, key: torch.Tensor) -> bool:
        """Whether ``__call__`` takes these (else use the torch path)."""
        return (
            self.available
            and query.dtype == torch.bfloat16
            and query.shape[2] % 32 == 0
            and query.shape[2] <= 256
        )

    def __call__(
        self,
        query: torch.Tensor,  # [query_len, heads, head_dim] bf16
        key: torch.Tensor,  # [context_len, kv_heads, head_dim] bf16
        value: torch.Tensor,  # [context_len, kv_heads, head_dim] bf16
        scale: float,
    ) -> torch.Tensor:
        """Query row ``i`` attends keys ``0 .. context_len - query_len + i``; returns
        ``[query_len, heads, head_dim]``. Raises ``ValueError`` for arguments it cannot take."""
        query_len, num_heads, head_dim = query.shape
        context_len, num_kv_heads, key_dim = key.shape
        if (
            not self.supports(query, key)
            or {key.dtype, value.dtype} != {torch.bfloat16}
            or value.shape != key.shape
            or key_dim != head_dim
            or num_heads % num_kv_heads
            or not 0 < query_len <= context_len
        ):
            raise ValueError("prefill attention: unsupported shapes, dtypes or lengths")
        if not _rows_dense(query):
            query = query.contiguous()
        if not _rows_dense(key):
            key = key.contiguous()
        if not _rows_dense(value):
            value = value.contiguous()
        out = query.new_empty(query_len, num_heads, head_dim)
        status = self._run(out, query, key, value, scale)
        if status != 0:
            raise ValueError(f"prefill attention kernel refused its arguments (code {status})")
        return out


@functools.cache
def load_cpu_prefill_attention(
    level: str | None = None,
) -> CpuPrefillAttention | None:
    """The compiled prefill kernel if it has its AVX-512 BF16 path here, else None."""
    library = load_library("prefill_attention", level)
    if library is None:
        return None
    kernel = CpuPrefillAttention(library)
    return kernel if kernel.available else None


@functools.cache
def load_cpu_decode_attention(level: str | None = None) -> CpuDecodeAttention | None:
    """The compiled kernel, or None (logged) if disabled or its library does not load here."""
    library = load_library("paged_decode_attention", level)
    return None if library is None else CpuDecodeAttention(library)
