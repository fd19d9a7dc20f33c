"""Paged decode attention, prefill (context) attention and the KV store kernel against their
torch references, under Triton's CPU interpreter (small shapes: the interpreter is slow)."""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels.interpret import triton_interpreter

with triton_interpreter():  # triton and the kernels must first be imported in interpreter mode
    pytest.importorskip("triton")
    from splitserve.kernels import decode_attention, prefill_attention, store_kv

TOLERANCES = {  # bf16: the interpreter truncates float32 -> bf16 (GPUs round to nearest)
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
DTYPES = list(TOLERANCES)
GQA = [(4, 4), (6, 3), (9, 3)]  # (heads, kv_heads): groups of 1, 2 and 3 query heads
NUM_BLOCKS = 128


def _cache(block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    """Random key and value caches ``[NUM_BLOCKS, block_size, kv_heads, head_dim]``, as views
    of one engine-layout tensor ``[layers=2, 2, ...]`` (layer 1: non-zero storage offset)."""
    kv = torch.randn(2, 2, NUM_BLOCKS, block_size, kv_heads, head_dim).to(dtype)
    return kv[1, 0], kv[1, 1]


def _tables(num_seqs: int, max_blocks: int) -> torch.Tensor:
    """Distinct random block ids: ``[num_seqs, max_blocks]`` int32."""
    return torch.randperm(NUM_BLOCKS)[: num_seqs * max_blocks].view(num_seqs, max_blocks).int()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(
    dtype: torch.dtype, heads: int, kv_heads: int, num_splits: int
) -> None:
    torch.manual_seed(0)
    block_size, head_dim = 4, 16
    # Length 1, an empty slot, exactly one block, one past a boundary, one short of two blocks.
    seq_lens = torch.tensor([1, 0, 4, 5, 7, 37], dtype=torch.int32)
    key_cache, value_cache = _cache(block_size, kv_heads, head_dim, dtype)
    tables = _tables(len(seq_lens), 10)
    query = torch.randn(len(seq_lens), heads, head_dim).to(dtype)
    got = decode_attention.paged_decode_attention(
        query, key_cache, value_cache, tables, seq_lens, head_dim**-0.5,
        num_splits=num_splits, block_n=16,  # several loop steps per split: online rescaling
    )  # fmt: skip
    expected = decode_attention.paged_decode_attention_ref(
        query, key_cache, value_cache, tables, seq_lens, head_dim**-0.5
    )
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, **TOLERANCES[dtype])
    assert not got[1].any(), "an empty batch slot gives zeros"


@pytest.mark.parametrize("num_splits", [None, 5])
def test_decode_long_context_odd_block_size_and_head_dim(num_splits: int | None) -> None:
    """Up to 5 splits over 180 tokens, block size 5 (not a power of 2), head_dim 24 (padded),
    int64 index tensors, a strided query view; ``max_seq_len`` given (no sync)."""
    torch.manual_seed(1)
    block_size, kv_heads, heads, head_dim = 5, 2, 6, 24
    seq_lens = torch.tensor([180, 3, 96])
    key_cache, value_cache = _cache(block_size, kv_heads, head_dim, torch.float32)
    tables = _tables(3, 36).long()
    query = torch.randn(3, heads + 2 * kv_heads, head_dim)[:, :heads]  # [batch, heads, dim]
    got = decode_attention.paged_decode_attention(
        query, key_cache, value_cache, tables, seq_lens, 0.3, max_seq_len=180,
        num_splits=num_splits,
    )  # fmt: skip
    expected = decode_attention.paged_decode_attention_ref(
        query, key_cache, value_cache, tables, seq_lens, 0.3
    )
    torch.testing.assert_close(got, expected, **TOLERANCES[torch.float32])


def test_decode_single_split_of_each_sequence_is_independent_of_batch() -> None:
    torch.manual_seed(2)
    key_cache, value_cache = _cache(4, 2, 16, torch.float32)
    tables = _tables(3, 8)
    query = torch.randn(3, 4, 16)
    lens = torch.tensor([9, 30, 2], dtype=torch.int32)
    batched = decode_attention.paged_decode_attention(
        query, key_cache, value_cache, tables, lens, 0.25, num_splits=1
    )
    alone = decode_attention.paged_decode_attention(
        query[1:2], key_cache, value_cache, tables[1:2], lens[1:2], 0.25, num_splits=1
    )
    assert torch.equal(batched[1:2], alone)


def test_split_tokens_cover_the_sequence_in_whole_tiles() -> None:
    for seq_len in (0, 1, 7, 45, 200, 4096, 4097):
        for num_splits in (1, 3, 33):
            for min_tokens, block_n in ((1, 16), (16, 16), (256, 64)):
                tokens = decode_attention.split_tokens(seq_len, num_splits, min_tokens, block_n)
                assert tokens % block_n == 0 and tokens >= min_tokens
                assert tokens * num_splits >= seq_len, (seq_len, num_splits, min_tokens)


def test_decode_row_splits_follow_its_own_length() -> None:
    """A launch sized for the tables' whole width (a CUDA graph's) cuts each row by its own
    length: every row equals the row run alone at its own length (its ranges the same, the
    launch's extra programs empty), and the reference."""
    torch.manual_seed(4)
    key_cache, value_cache = _cache(4, 2, 16, torch.float32)
    tables = _tables(4, 32)  # capacity 128 tokens
    query = torch.randn(4, 4, 16)
    lens = torch.tensor([120, 7, 45, 0], dtype=torch.int32)
    options = {"num_splits": 4, "min_split_tokens": 16, "block_n": 16}
    batched = decode_attention.paged_decode_attention(
        query, key_cache, value_cache, tables, lens, 0.25, max_seq_len=128, **options
    )
    for row, length in enumerate(lens.tolist()):
        alone = decode_attention.paged_decode_attention(
            query[row : row + 1], key_cache, value_cache, tables[row : row + 1],
            lens[row : row + 1], 0.25, max_seq_len=length, **options,
        )  # fmt: skip
        assert torch.equal(batched[row : row + 1], alone), row
    expected = decode_attention.paged_decode_attention_ref(
        query, key_cache, value_cache, tables, lens, 0.25
    )
    torch.testing.assert_close(batched, expected, **TOLERANCES[torch.float32])


def _packed_batch(shapes: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``query_start [seqs + 1]`` and ``context_lens [seqs]`` int32 of (query_len, context_len)."""
    query_lens = torch.tensor([query_len for query_len, _ in shapes])
    query_start = torch.cat([torch.zeros(1, dtype=torch.int64), query_lens.cumsum(0)]).int()
    return query_start, torch.tensor([context for _, context in shapes], dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
def test_context_attention_matches_reference(dtype: torch.dtype, heads: int, kv_heads: int) -> None:
    torch.manual_seed(3)
    block_size, head_dim = 4, 16
    # Fresh prompt; empty slot; chunk after a cached prefix across a boundary; one token after
    # a prefix; exactly two blocks; chunk starting on a block boundary after 32 cached tokens.
    shapes = [(7, 7), (0, 3), (5, 21), (1, 9), (8, 8), (6, 38)]
    query_start, context_lens = _packed_batch(shapes)
    key_cache, value_cache = _cache(block_size, kv_heads, head_dim, dtype)
    tables = _tables(len(shapes), 10)
    query = torch.randn(int(query_start[-1]), heads, head_dim).to(dtype)
    got = prefill_attention.context_attention(
        query, key_cache, value_cache, tables, query_start, context_lens, head_dim**-0.5,
        block_n=16,  # several key steps per program: online rescaling, diagonal masking
    )  # fmt: skip
    expected = prefill_attention.context_attention_ref(
        query, key_cache, value_cache, tables, query_start, context_lens, head_dim**-0.5
    )
    torch.testing.assert_close(got, expected, **TOLERANCES[dtype])


def test_context_attention_several_query_tiles() -> None:
    """70 queries after a 6-token prefix: two BLOCK_M tiles, the second partly masked."""
    torch.manual_seed(4)
    shapes = [(70, 76), (2, 2)]
    query_start, context_lens = _packed_batch(shapes)
    key_cache, value_cache = _cache(8, 1, 16, torch.float16)
    tables = _tables(2, 10)
    query = torch.randn(72, 2, 16).half()
    got = prefill_attention.context_attention(
        query, key_cache, value_cache, tables, query_start, context_lens, 0.25, max_query_len=70
    )
    expected = prefill_attention.context_attention_ref(
        query, key_cache, value_cache, tables, query_start, context_lens, 0.25
    )
    torch.testing.assert_close(got, expected, **TOLERANCES[torch.float16])


def test_prefill_attention_writes_new_kv_then_attends_over_prefix() -> None:
    torch.manual_seed(5)
    block_size, kv_heads, heads, head_dim = 4, 2, 6, 16
    shapes = [(5, 13), (3, 3)]
    query_start, context_lens = _packed_batch(shapes)
    key_cache, value_cache = _cache(block_size, kv_heads, head_dim, torch.float32)
    tables = _tables(2, 4)
    slots = [
        int(tables[seq, pos // block_size]) * block_size + pos % block_size
        for seq, (query_len, context_len) in enumerate(shapes)
        for pos in range(context_len - query_len, context_len)
    ]
    slot_mapping = torch.tensor(slots)
    query = torch.randn(8, heads, head_dim)
    key, value = torch.randn(8, kv_heads, head_dim), torch.randn(8, kv_heads, head_dim)
    expected_key_cache, expected_value_cache = key_cache.clone(), value_cache.clone()
    store_kv.store_kv_ref(key, value, expected_key_cache, expected_value_cache, slot_mapping)
    expected = prefill_attention.context_attention_ref(
        query, expected_key_cache, expected_value_cache, tables, query_start, context_lens, 0.25
    )
    got = prefill_attention.prefill_attention(
        query, key, value, key_cache, value_cache, slot_mapping, tables, query_start,
        context_lens, 0.25,
    )  # fmt: skip
    assert torch.equal(key_cache, expected_key_cache)
    assert torch.equal(value_cache, expected_value_cache)
    torch.testing.assert_close(got, expected, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_strided_views_and_skipped_slots(dtype: torch.dtype) -> None:
    torch.manual_seed(6)
    kv_heads, head_dim = 3, 8
    qkv = torch.randn(5, (6 + 2 * kv_heads) * head_dim).to(dtype)  # fused projection output
    key = qkv[:, 6 * head_dim : 9 * head_dim].view(5, kv_heads, head_dim)  # strided views
    value = qkv[:, 9 * head_dim :].view(5, kv_heads, head_dim)
    key_cache, value_cache = _cache(3, kv_heads, head_dim, dtype)
    expected_key_cache, expected_value_cache = key_cache.clone(), value_cache.clone()
    slot_mapping = torch.tensor([0, 11, -1, 5, 3 * NUM_BLOCKS - 1])  # -1: padding, skipped
    store_kv.store_kv(key, value, key_cache, value_cache, slot_mapping)
    store_kv.store_kv_ref(key, value, expected_key_cache, expected_value_cache, slot_mapping)
    assert torch.equal(key_cache, expected_key_cache)
    assert torch.equal(value_cache, expected_value_cache)


def _decode_args() -> dict[str, object]:
    key_cache, value_cache = _cache(4, 2, 16, torch.float32)
    return {
        "query": torch.randn(2, 6, 16),
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_tables": _tables(2, 3),
        "seq_lens": torch.tensor([3, 9], dtype=torch.int32),
        "scale": 0.25,
    }


@pytest.mark.parametrize(
    ("name", "bad", "message"),
    [
        ("query", torch.randn(2, 5, 16), "multiple of kv_heads"),
        ("query", torch.randn(2, 6, 16).half(), "`key_cache` has dtype torch.float32"),
        ("query", torch.randn(2, 6, 32)[:, :, ::2], "contiguous last dimension"),
        ("query", torch.randn(2, 6, 16).int(), "`query` must have dtype"),
        ("key_cache", torch.randn(128, 4, 2, 8), "`key_cache` must have shape [*, *, *, 16]"),
        ("value_cache", torch.randn(128, 4, 1, 16), "`value_cache` must have shape"),
        ("block_tables", torch.zeros(2, 3), "`block_tables` must have dtype"),
        ("block_tables", torch.zeros(3, 3, dtype=torch.int32), "`block_tables` must have shape"),
        ("seq_lens", torch.tensor([3, 9, 1]), "`seq_lens` must have shape [2]"),
        ("seq_lens", torch.tensor([3.0, 9.0]), "`seq_lens` must have dtype"),
    ],
)
def test_decode_wrapper_rejects_bad_inputs(name: str, bad: torch.Tensor, message: str) -> None:
    args = _decode_args() | {name: bad}
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("*", r"\*")):
        decode_attention.paged_decode_attention(**args)


def test_decode_wrapper_rejects_context_beyond_block_tables() -> None:
    with pytest.raises(ValueError, match="exceeds the block tables' 12 slots"):
        decode_attention.paged_decode_attention(**_decode_args(), max_seq_len=13)


def test_context_attention_rejects_mismatched_metadata() -> None:
    key_cache, value_cache = _cache(4, 2, 16, torch.float32)
    query = torch.randn(5, 6, 16)
    with pytest.raises(ValueError, match=r"`query_start` must have shape \[3\]"):
        prefill_attention.context_attention(
            query, key_cache, value_cache, _tables(2, 3), torch.tensor([0, 5]),
            torch.tensor([5, 1]), 0.25,
        )  # fmt: skip
    with pytest.raises(ValueError, match="`value` must have shape"):
        store_kv.store_kv(
            torch.randn(5, 2, 16), torch.randn(4, 2, 16), key_cache, value_cache, torch.arange(5)
        )
