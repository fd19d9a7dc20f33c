"""The Triton kernels compiled for a CUDA GPU against their torch references, in bfloat16 and
float32, at the shapes real models use (Llama-8B's heads: 32 query heads, 8 KV heads,
head_dim 128; the default model's: 9, 3, 64; block size 16; contexts up to 4,096 tokens).

Marked ``gpu``: deselected by default and skipped without CUDA; ``bench/gpu/run.sh`` runs them
on a lent GPU machine (``pytest -m gpu``). The interpreter tests (``test_kernels_*.py``) check the
same kernels on CPU tensors at small shapes. Triton decides between compiling and interpreting
when a kernel module is first imported, so this module imports the kernels only inside its
fixture, and only where CUDA is present: collected beside the interpreter tests (the default
suite), it imports no kernel.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOLERANCES = {  # compiled kernels round to nearest; float32 products are IEEE (not TF32)
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
DTYPES = list(TOLERANCES)
HEAD_SHAPES = [(32, 8, 128), (9, 3, 64)]  # (heads, kv_heads, head_dim): Llama-8B, SmolLM2
BLOCK_SIZE = 16
NUM_BLOCKS = 2048
DEVICE = "cuda"


@pytest.fixture(scope="module")
def kernels() -> SimpleNamespace:
    """The kernel modules, compiled (imported here, never in interpreter mode)."""
    pytest.importorskip("triton")
    from splitserve.kernels import (
        activation,
        decode_attention,
        kv_pack,
        prefill_attention,
        rms_norm,
        rotary,
        store_kv,
    )
    from splitserve.kernels.triton_backend import TritonAttentionBackend

    return SimpleNamespace(
        activation=activation,
        decode_attention=decode_attention,
        kv_pack=kv_pack,
        prefill_attention=prefill_attention,
        rms_norm=rms_norm,
        rotary=rotary,
        store_kv=store_kv,
        TritonAttentionBackend=TritonAttentionBackend,
    )


def _cache(kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Random key and value caches ``[NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim]``: views of
    one engine-layout tensor ``[layers=2, 2, ...]`` (layer 1: a non-zero storage offset)."""
    kv = torch.randn(2, 2, NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim, device=DEVICE).to(dtype)
    return kv[1, 0], kv[1, 1]


def _tables(num_seqs: int, max_blocks: int) -> torch.Tensor:
    """Distinct random block ids ``[num_seqs, max_blocks]`` int32."""
    ids = torch.randperm(NUM_BLOCKS, device=DEVICE)[: num_seqs * max_blocks]
    return ids.view(num_seqs, max_blocks).int()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), HEAD_SHAPES)
@pytest.mark.parametrize("num_splits", [None, 1, 8])
def test_decode_attention(
    kernels, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, num_splits: int | None
) -> None:
    torch.manual_seed(0)
    # One token, an empty slot, a block boundary, one past it, long and very long contexts.
    seq_lens = torch.tensor([1, 0, 16, 17, 1000, 4096, 2500, 333], dtype=torch.int32)
    key_cache, value_cache = _cache(kv_heads, head_dim, dtype)
    tables = _tables(len(seq_lens), 4096 // BLOCK_SIZE)
    query = torch.randn(len(seq_lens), heads, head_dim, device=DEVICE).to(dtype)
    scale = head_dim**-0.5
    got = kernels.decode_attention.paged_decode_attention(
        query, key_cache, value_cache, tables, seq_lens.to(DEVICE), scale,
        max_seq_len=4096, num_splits=num_splits,
    )  # fmt: skip
    expected = kernels.decode_attention.paged_decode_attention_ref(
        query, key_cache, value_cache, tables, seq_lens.to(DEVICE), scale
    )
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, **TOLERANCES[dtype])
    assert not got[1].any(), "an empty batch slot gives zeros"


def _packed_batch(shapes: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``query_start [seqs + 1]`` and ``context_lens [seqs]`` int32 of (query_len, context_len)."""
    query_lens = torch.tensor([query_len for query_len, _ in shapes])
    query_start = torch.cat([torch.zeros(1, dtype=torch.int64), query_lens.cumsum(0)]).int()
    contexts = torch.tensor([context for _, context in shapes], dtype=torch.int32)
    return query_start.to(DEVICE), contexts.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), HEAD_SHAPES)
def test_prefill_attention(
    kernels, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    """New keys stored into their slots, then causal attention over cached prefixes: a fresh
    512-token prompt, a chunk after a 1,000-token prefix, one token after a prefix, an empty
    slot, a chunk starting on a block boundary."""
    torch.manual_seed(1)
    shapes = [(512, 512), (300, 1300), (1, 77), (0, 5), (64, 128)]
    query_start, context_lens = _packed_batch(shapes)
    key_cache, value_cache = _cache(kv_heads, head_dim, dtype)
    tables = _tables(len(shapes), 1300 // BLOCK_SIZE + 1)
    slots = [
        int(tables[seq, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE
        for seq, (query_len, context_len) in enumerate(shapes)
        for pos in range(context_len - query_len, context_len)
    ]
    slot_mapping = torch.tensor(slots, device=DEVICE)
    tokens = len(slots)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=DEVICE).to(dtype)
    query = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # strided views
    key = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    value = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    expected_key_cache, expected_value_cache = key_cache.clone(), value_cache.clone()
    kernels.store_kv.store_kv_ref(
        key, value, expected_key_cache, expected_value_cache, slot_mapping
    )
    scale = head_dim**-0.5
    expected = kernels.prefill_attention.context_attention_ref(
        query, expected_key_cache, expected_value_cache, tables, query_start, context_lens, scale
    )
    got = kernels.prefill_attention.prefill_attention(
        query, key, value, key_cache, value_cache, slot_mapping, tables, query_start,
        context_lens, scale, max_query_len=512,
    )  # fmt: skip
    assert torch.equal(key_cache, expected_key_cache)
    assert torch.equal(value_cache, expected_value_cache)
    torch.testing.assert_close(got, expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_skips_padding_slots(kernels, dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    kv_heads, head_dim = 8, 128
    key_cache, value_cache = _cache(kv_heads, head_dim, dtype)
    key = torch.randn(6, kv_heads, head_dim, device=DEVICE).to(dtype)
    value = torch.randn(6, kv_heads, head_dim, device=DEVICE).to(dtype)
    slot_mapping = torch.tensor([0, 17, -1, 5, NUM_BLOCKS * BLOCK_SIZE - 1, 300], device=DEVICE)
    expected_key_cache, expected_value_cache = key_cache.clone(), value_cache.clone()
    kernels.store_kv.store_kv(key, value, key_cache, value_cache, slot_mapping)
    kernels.store_kv.store_kv_ref(
        key, value, expected_key_cache, expected_value_cache, slot_mapping
    )
    assert torch.equal(key_cache, expected_key_cache)
    assert torch.equal(value_cache, expected_value_cache)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layers", [None, [31, 0, 7]])
def test_kv_pack_round_trip(kernels, dtype: torch.dtype, layers: list[int] | None) -> None:
    """Llama-8B's cache layout ``[layers=32, 2, blocks, 16, 8, 128]``, scattered block ids."""
    torch.manual_seed(3)
    kv = torch.randn(32, 2, 64, BLOCK_SIZE, 8, 128, device=DEVICE).to(dtype)
    block_ids = torch.tensor([40, 2, 63, 0, 17], dtype=torch.int32, device=DEVICE)
    packed = kernels.kv_pack.pack_kv(kv, block_ids, layers)
    assert packed.is_contiguous()
    assert torch.equal(packed, kernels.kv_pack.pack_kv_ref(kv, block_ids, layers))
    received = torch.randn(packed.shape, device=DEVICE).to(dtype)
    got, expected = kv.clone(), kv.clone()
    kernels.kv_pack.unpack_kv(received, got, block_ids, layers)
    kernels.kv_pack.unpack_kv_ref(received, expected, block_ids, layers)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [576, 4096])
def test_rms_norm(kernels, dtype: torch.dtype, with_residual: bool, hidden: int) -> None:
    torch.manual_seed(4)
    x = torch.randn(33, hidden + 64, device=DEVICE).to(dtype)[:, :hidden]  # strided rows
    weight = torch.randn(hidden, device=DEVICE).to(dtype)
    residual = torch.randn(33, hidden, device=DEVICE).to(dtype) if with_residual else None
    got = kernels.rms_norm.rms_norm(x, weight, 1e-5, residual)
    expected = kernels.rms_norm.rms_norm_ref(x, weight, 1e-5, residual)
    torch.testing.assert_close(got, expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), HEAD_SHAPES)
def test_rotary(kernels, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    from splitserve.engine.model_config import RopeScaling
    from splitserve.engine.rotary import cos_sin_table

    torch.manual_seed(5)
    tokens = 37
    cos, sin = cos_sin_table(head_dim, 500000.0, RopeScaling(), 8192, dtype, DEVICE)
    positions = torch.randint(0, 8192, (tokens,), device=DEVICE)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=DEVICE).to(dtype)
    query_key = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    query, key = query_key[:, :heads], query_key[:, heads:]  # strided views
    expected_query = kernels.rotary.rotary_embedding_ref(query, cos, sin, positions)
    expected_key = kernels.rotary.rotary_embedding_ref(key, cos, sin, positions)
    kernels.rotary.rotary_embedding(query, key, cos, sin, positions)
    torch.testing.assert_close(query, expected_query, **TOLERANCES[dtype])
    torch.testing.assert_close(key, expected_key, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 14336])
def test_silu_and_mul(kernels, dtype: torch.dtype, inter: int) -> None:
    torch.manual_seed(6)
    x = torch.randn(19, 2 * inter, device=DEVICE).to(dtype)  # [rows, 2 * inter]
    got = kernels.activation.silu_and_mul(x)  # [rows, inter]
    torch.testing.assert_close(got, kernels.activation.silu_and_mul_ref(x), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_triton_backend_matches_torch_backend(
    kernels, dtype: torch.dtype, batch_invariant: bool
) -> None:
    """One layer of the engine's packed batch (decodes first, then prefill chunks) through both
    attention backends: same output, same cache."""
    from splitserve.kernels.attention import SequenceSpan, TorchAttentionBackend

    heads, kv_heads, head_dim = 32, 8, 128
    # (query_len, context_len): three decodes, a fresh prompt, a chunk after a cached prefix.
    shapes = [(1, 700), (1, 16), (1, 1), (200, 200), (50, 530)]
    tables = [list(range(start, start + 50)) for start in range(0, 250, 50)]
    outputs = []
    for backend in (
        TorchAttentionBackend(batch_invariant=batch_invariant),
        kernels.TritonAttentionBackend(batch_invariant=batch_invariant),
    ):
        torch.manual_seed(7)
        key_cache, value_cache = _cache(kv_heads, head_dim, dtype)
        tokens = sum(query_len for query_len, _ in shapes)
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=DEVICE).to(dtype)
        query = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
        key = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(
            tokens, kv_heads, head_dim
        )
        value = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
        spans = [SequenceSpan(q, c, t) for (q, c), t in zip(shapes, tables, strict=True)]
        metadata = backend.prepare(spans, 3, BLOCK_SIZE, torch.device(DEVICE))
        output = backend.forward(
            query, key, value, key_cache, value_cache, metadata, head_dim**-0.5
        )
        outputs.append((output, key_cache, value_cache))
    (torch_out, torch_keys, torch_values), (triton_out, triton_keys, triton_values) = outputs
    assert torch.equal(triton_keys, torch_keys)
    assert torch.equal(triton_values, torch_values)
    torch.testing.assert_close(triton_out, torch_out, **TOLERANCES[dtype])
