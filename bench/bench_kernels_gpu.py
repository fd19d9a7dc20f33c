"""GPU benchmarks of the Triton kernels (CUDA only); prints one JSON object.

- decode attention, batch 64 x 4096-token contexts (Llama-8B-like heads: 32 query heads,
  8 KV heads, head_dim 128, bf16, block size 16): time, achieved KV read bandwidth, and the
  same against a device-to-device copy measured in the same run; speed vs the torch backend's
  path (gather the blocks, then SDPA);
- KV pack/unpack of one 4096-token request over 32 layers vs a device copy of the same bytes;
- the decode kernel at each split count for the step shapes ``step_times.py`` times
  (``bench_decode_splits``), beside the count the default picks;
- the sampler's choice for top-p rows read on the host against the wait-free one a step
  launched ahead runs (``bench_top_p_choice``).

Times are medians of CUDA-event timings after warm-up. Without CUDA it exits at once with a
message (the module imports without CUDA or Triton).

    .venv/bin/python bench/bench_kernels_gpu.py
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

WARMUP = 3
REPEATS = 20


def time_ms(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    """Median milliseconds of ``fn`` on the current CUDA stream."""
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_gbps(num_bytes: int) -> float:
    """Device copy bandwidth, bytes read + written per second (GB/s)."""
    source = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    return 2 * num_bytes / time_ms(lambda: target.copy_(source)) / 1e6


@dataclass(frozen=True)
class DecodeInputs:
    """A decode attention call's random inputs on CUDA: every sequence ``context`` tokens
    long, its blocks a random permutation of the caches'."""

    query: torch.Tensor  # [batch, heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor  # same shape
    tables: torch.Tensor  # [batch, blocks per sequence] int64
    seq_lens: torch.Tensor  # [batch] int32, all ``context``
    kv_bytes: int
    """Bytes of keys and values the sequences hold (what one call must read)."""

    @classmethod
    def random(
        cls,
        batch: int,
        context: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
    ) -> DecodeInputs:
        blocks_per_seq = -(-context // block_size)
        num_blocks = batch * blocks_per_seq
        cache_shape = (num_blocks, block_size, kv_heads, head_dim)
        key_cache = torch.randn(cache_shape, dtype=dtype, device="cuda")
        return cls(
            query=torch.randn(batch, heads, head_dim, dtype=dtype, device="cuda"),
            key_cache=key_cache,
            value_cache=torch.randn_like(key_cache),
            tables=torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_seq),
            seq_lens=torch.full((batch,), context, dtype=torch.int32, device="cuda"),
            kv_bytes=2 * batch * context * kv_heads * head_dim * key_cache.element_size(),
        )


def bench_decode(
    batch: int = 64,
    context: int = 4096,
    heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, object]:
    from splitserve.kernels.attention import decode_attention as torch_decode_attention
    from splitserve.kernels.decode_attention import default_num_splits, paged_decode_attention

    inputs = DecodeInputs.random(batch, context, heads, kv_heads, head_dim, block_size, dtype)
    query, key_cache, value_cache = inputs.query, inputs.key_cache, inputs.value_cache
    tables32 = inputs.tables.int()
    scale = head_dim**-0.5
    mask = torch.ones(batch, 1, 1, context, dtype=torch.bool, device="cuda")

    def triton_run() -> torch.Tensor:
        return paged_decode_attention(
            query, key_cache, value_cache, tables32, inputs.seq_lens, scale, max_seq_len=context
        )

    def torch_run() -> torch.Tensor:
        return torch_decode_attention(query, key_cache, value_cache, inputs.tables, mask, scale)

    max_error = (triton_run().float() - torch_run().float()).abs().max().item()
    triton_ms, torch_ms = time_ms(triton_run), time_ms(torch_run)
    kv_bytes = inputs.kv_bytes
    achieved = kv_bytes / triton_ms / 1e6
    copy = copy_gbps(kv_bytes)
    return {
        "shape": {"batch": batch, "context": context, "heads": heads, "kv_heads": kv_heads},
        "head_dim": head_dim,
        "block_size": block_size,
        "dtype": str(dtype).removeprefix("torch."),
        "num_splits": default_num_splits(batch, kv_heads, context, query.device),
        "triton_ms": round(triton_ms, 4),
        "kv_read_gbps": round(achieved, 1),
        "device_copy_gbps": round(copy, 1),
        "fraction_of_copy_bandwidth": round(achieved / copy, 3),
        "torch_gather_sdpa_ms": round(torch_ms, 4),
        "speedup_vs_torch": round(torch_ms / triton_ms, 2),
        "max_abs_error_vs_torch": max_error,
    }


SPLIT_SWEEP_SHAPES = ((1, 525), (8, 525), (64, 525), (64, 4096))
"""(batch, context) of the decode steps ``step_times.py`` times, and the long-context case."""
SPLIT_SWEEP_COUNTS = (1, 2, 4, 8, 16, 32)


def bench_decode_splits(
    kv_heads: int = 8, heads: int = 32, head_dim: int = 128, block_size: int = 16
) -> list[dict[str, object]]:
    """The decode kernel's time at each split count (``SPLIT_SWEEP_COUNTS``) for Llama-8B's
    heads at each ``SPLIT_SWEEP_SHAPES`` (bf16), beside the count the default picks: whether
    ``splits_for_sms``'s two programs per SM leave the memory idle. ``effective_splits``: the
    ranges a row is cut into (``split_tokens``; a count asked beyond the context's tiles gives
    fewer)."""
    from splitserve.kernels.decode_attention import (
        default_block_n,
        default_num_splits,
        paged_decode_attention,
        split_tokens,
    )

    results: list[dict[str, object]] = []
    for batch, context in SPLIT_SWEEP_SHAPES:
        inputs = DecodeInputs.random(
            batch, context, heads, kv_heads, head_dim, block_size, torch.bfloat16
        )
        tables = inputs.tables.int()
        default = default_num_splits(batch, kv_heads, context, inputs.query.device)
        for splits in sorted({*SPLIT_SWEEP_COUNTS, default}):
            run = functools.partial(
                paged_decode_attention, inputs.query, inputs.key_cache, inputs.value_cache,
                tables, inputs.seq_lens, head_dim**-0.5, max_seq_len=context, num_splits=splits,
            )  # fmt: skip
            milliseconds = time_ms(run)
            tokens = split_tokens(context, splits, 1, default_block_n(context, splits))
            results.append(
                {
                    "batch": batch,
                    "context": context,
                    "num_splits": splits,
                    "effective_splits": -(-context // tokens),
                    "default": splits == default,
                    "ms": round(milliseconds, 4),
                    "kv_read_gbps": round(inputs.kv_bytes / milliseconds / 1e6, 1),
                }
            )
    return results


CHOICE_BATCHES = (1, 8, 64)
CHOICE_VOCAB = 128_256
"""Llama-3's vocabulary: what the 8B-shaped engine samples over."""


def bench_top_p_choice(
    device: str = "cuda",
    vocab: int = CHOICE_VOCAB,
    batches: tuple[int, ...] = CHOICE_BATCHES,
    timer: Callable[[Callable[[], object]], float] = time_ms,
) -> list[dict[str, object]]:
    """A step's choice for sampled rows at temperature 0.7, top-p 0.9, each row seeded: read on
    the host (``Sampler.choose``: the rows whose nucleus lies beyond the candidates found on
    the host, looked for among 4,096, then sorted) against ``wait_free`` (every top-p row
    sorted, nothing read: what a step launched ahead runs), beside greedy's argmax, for
    peaked logits (the nucleus within the candidates, as a trained model's usually is) and
    flat ones (beyond them). ``same``:
    both gave every row the same token (each run from generators seeded alike)."""
    from splitserve.common.sampling_params import SamplingParams
    from splitserve.engine.sampler import Sampler, SamplingRow

    params = SamplingParams(temperature=0.7, top_p=0.9)

    def rows(batch: int) -> list[SamplingRow]:
        return [
            SamplingRow(params, torch.Generator(device).manual_seed(i), (), (), frozenset())
            for i in range(batch)
        ]

    results: list[dict[str, object]] = []
    for batch in batches:
        for shape, scale in (("peaked", 6.0), ("flat", 0.3)):
            logits = torch.randn(batch, vocab, device=device) * scale  # [batch, vocab]
            same = torch.equal(
                Sampler().choose(logits, rows(batch)),
                Sampler().choose(logits, rows(batch), wait_free=True),
            )
            choose = functools.partial(Sampler().choose, logits, rows(batch))
            results.append(
                {
                    "batch": batch,
                    "vocab": vocab,
                    "logits": shape,
                    "same": same,
                    "greedy_ms": round(timer(functools.partial(logits.argmax, dim=-1)), 4),
                    "read_ms": round(timer(choose), 4),
                    "wait_free_ms": round(timer(functools.partial(choose, wait_free=True)), 4),
                }
            )
    return results


def bench_pack(
    layers: int = 32,
    tokens: int = 4096,
    block_size: int = 16,
    kv_heads: int = 8,
    head_dim: int = 128,
    num_blocks: int = 1024,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, object]:
    from splitserve.kernels.kv_pack import pack_kv, unpack_kv

    kv = torch.randn(
        layers, 2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device="cuda"
    )
    block_ids = torch.randperm(num_blocks, device="cuda")[: tokens // block_size]  # [blocks]
    buffer = pack_kv(kv, block_ids)  # [layers, 2, blocks, block_size, kv_heads, head_dim]
    restored = torch.zeros_like(kv)
    unpack_kv(buffer, restored, block_ids)
    exact = torch.equal(restored[:, :, block_ids.long()], kv[:, :, block_ids.long()])
    pack_ms = time_ms(lambda: pack_kv(kv, block_ids, out=buffer))
    unpack_ms = time_ms(lambda: unpack_kv(buffer, restored, block_ids))
    num_bytes = buffer.numel() * buffer.element_size()
    copy = copy_gbps(num_bytes)
    return {
        "layers": layers,
        "tokens": tokens,
        "buffer_bytes": num_bytes,
        "round_trip_exact": exact,
        "pack_ms": round(pack_ms, 4),
        "pack_gbps": round(2 * num_bytes / pack_ms / 1e6, 1),
        "unpack_ms": round(unpack_ms, 4),
        "unpack_gbps": round(2 * num_bytes / unpack_ms / 1e6, 1),
        "device_copy_gbps": round(copy, 1),
    }


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench_kernels_gpu: needs a CUDA device (torch.cuda.is_available() is False)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("bench_kernels_gpu: unset TRITON_INTERPRET to benchmark compiled kernels")
    torch.manual_seed(0)
    result = {
        "device": torch.cuda.get_device_name(),
        "decode_attention": bench_decode(),
        "kv_pack": bench_pack(),
    }
    extras = {"decode_attention_splits": bench_decode_splits, "top_p_choice": bench_top_p_choice}
    for name, bench in extras.items():
        try:
            result[name] = bench()
        except Exception as error:  # noqa: BLE001 - an extra; the rest stands
            result[name] = {"error": f"{type(error).__name__}: {error}"}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
