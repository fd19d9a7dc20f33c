"""Decode-step graphs' bookkeeping on the CPU (``engine/decode_graphs.py``): bucket choice, the
static buffers a graph reads, the eager fallback, and whole generations through replayed steps.

A replay here is ``record_step``'s: it reruns the captured closure, which reads only the
static buffers, and rewrites the output tensor the capture returned, as a CUDA graph's replay
would. The model runs the Triton attention backend under Triton's interpreter (the backend the
CUDA graphs capture); the CUDA capture itself is tested on a GPU (``tests/test_gpu_engine.py``).
"""

from __future__ import annotations

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.config import CacheConfig, EngineConfig, ModelConfig, RunnerConfig
from splitserve.engine.decode_graphs import (
    BlockTableMirror,
    DecodeBatch,
    StaticDecodeInputs,
    bucket_for,
    graph_buckets,
    record_step,
)
from splitserve.engine.llm import LLM
from splitserve.engine.random_checkpoint import SHAPES, random_checkpoint
from splitserve.kernels.attention import SequenceSpan
from splitserve.kernels.interpret import triton_interpreter

with triton_interpreter():  # triton and the kernels must first be imported in interpreter mode
    pytest.importorskip("triton")
    from splitserve.kernels import triton_backend  # noqa: F401

BLOCK = 16
NEW_TOKENS = 8
WEIGHT_SEED, WEIGHT_STD = 1, 0.3
"""As in ``test_gpu_engine.py``: weights whose greedy choices are never near a tie."""


def test_buckets_cover_every_size_up_to_the_largest() -> None:
    assert graph_buckets(1) == (1,)
    assert graph_buckets(3) == (1, 2, 3)
    assert graph_buckets(8) == (1, 2, 4, 8)
    buckets = graph_buckets(256)
    assert buckets[:6] == (1, 2, 4, 8, 16, 24)
    assert buckets[-6:] == (112, 128, 160, 192, 224, 256)
    assert graph_buckets(300)[-2:] == (256, 300)
    for rows in range(1, 257):
        bucket = bucket_for(rows, buckets)
        assert bucket is not None and bucket >= rows
        stride = 4 if rows <= 8 else 8 if rows <= 64 else 16 if rows <= 128 else 32
        assert bucket - rows < stride, f"{rows} rows pad to {bucket}"
    assert bucket_for(0, buckets) is None
    assert bucket_for(257, buckets) is None
    with pytest.raises(ValueError):
        graph_buckets(0)


def test_fill_writes_rows_and_pads_the_bucket() -> None:
    inputs = StaticDecodeInputs(max_rows=8, max_blocks=4, block_size=BLOCK, device="cpu")
    inputs.block_tables.fill_(99)  # what earlier steps left
    batch = DecodeBatch(
        token_ids=[11, 12, 13],
        positions=[20, 0, 47],
        spans=[
            SequenceSpan(1, 21, [5, 7]),  # position 20: block 7, offset 4
            SequenceSpan(1, 1, [3]),
            SequenceSpan(1, 48, [1, 2, 9, 6]),  # position 47: block 9, offset 15
        ],
        logits_rows=[0, 1, 2],
    )
    assert inputs.fits(batch)
    inputs.fill(batch, bucket=4)
    assert inputs.token_ids[:4].tolist() == [11, 12, 13, 0]
    assert inputs.positions[:4].tolist() == [20, 0, 47, 0]
    assert inputs.slot_mapping[:4].tolist() == [7 * BLOCK + 4, 3 * BLOCK, 9 * BLOCK + 15, -1]
    assert inputs.seq_lens[:4].tolist() == [21, 1, 48, 0]
    # Each row's table up to its context; the columns past it and the padding row's table
    # keep what they held (the kernels read no further than a row's length).
    assert inputs.block_tables[:4].tolist() == [
        [5, 7, 0, 99],
        [3, 0, 0, 99],
        [1, 2, 9, 99],
        [99, 99, 99, 99],
    ]
    with pytest.raises(ValueError):
        inputs.fill(batch, bucket=2)
    inputs.pad(8)
    assert inputs.slot_mapping.tolist() == [-1] * 8
    assert inputs.seq_lens.tolist() == [0] * 8


def test_the_table_mirror_copies_appended_blocks_and_follows_every_table() -> None:
    """Rows come from per-request mirrors: blocks appended to a table between steps reach its
    row; two rows of one table (a request's drafts) take their own widths; a table rewritten in
    place is copied afresh; a new table is mirrored from scratch; mirrors of tables a step did
    not use are dropped."""
    mirror = BlockTableMirror(max_rows=4, max_blocks=6)
    first, second = [7, 3], [9]
    assert mirror.fill([first, second, first], [1, 1, 2]) == 2
    assert mirror.tables[:3, :2].tolist() == [[7, 0], [9, 0], [7, 3]]
    first.extend([11, 12])  # the request grew (KVCacheManager.allocate extends its list)
    assert mirror.fill([second, first], [1, 4]) == 4
    assert mirror.tables[:2, :4].tolist() == [[9, 0, 0, 0], [7, 3, 11, 12]]
    first[3] = 40  # its last block rewritten (not what the cache manager does): caught
    mirror.fill([first], [4])
    assert mirror.tables[0, :4].tolist() == [7, 3, 11, 40]
    assert mirror.fill([[5, 6, 8]], [3]) == 3  # another request's new list
    assert mirror.tables[0, :3].tolist() == [5, 6, 8]
    assert len(mirror._mirrors) == 1


def test_fits_only_decodes_within_the_tables() -> None:
    inputs = StaticDecodeInputs(max_rows=2, max_blocks=2, block_size=BLOCK, device="cpu")

    def batch(*spans: SequenceSpan) -> DecodeBatch:
        rows = list(range(len(spans)))
        return DecodeBatch(rows, rows, spans, rows)

    assert inputs.fits(batch(SequenceSpan(1, 2 * BLOCK, [0, 1])))
    assert not inputs.fits(batch(SequenceSpan(1, 2 * BLOCK + 1, [0, 1, 2])))  # past the tables
    assert not inputs.fits(batch(SequenceSpan(3, 3, [0])))  # a prompt chunk
    assert not inputs.fits(batch(*[SequenceSpan(1, 1, [i]) for i in range(3)]))  # too many rows


def _llm() -> LLM:
    checkpoint = random_checkpoint(
        SHAPES["tiny"], torch.float32, "cpu", seed=WEIGHT_SEED, std=WEIGHT_STD
    )
    config = EngineConfig(
        model=ModelConfig(dtype="float32"),
        cache=CacheConfig(num_blocks=64, block_size=BLOCK, enable_prefix_caching=False),
        runner=RunnerConfig(device="cpu", attention_backend="triton", num_threads=1),
    )
    return LLM(config=config, checkpoint=checkpoint)


def _prompts(count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    lengths = (1, 7, 16, 17, 40, 5)[:count]
    vocab = SHAPES["tiny"].vocab_size
    return [torch.randint(2, vocab, (n,), generator=generator).tolist() for n in lengths]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [list(output.token_ids) for output in llm.generate(prompts, params)]


def test_replayed_decode_steps_equal_eager_ones() -> None:
    """Six prompts' float32 greedy output through replayed decode steps (buckets padded: 6
    rows replay the 8-row graph) equals the eager engine's; capturing wrote no KV."""
    prompts = _prompts(6)
    expected = _greedy(_llm(), prompts)
    llm = _llm()
    runner = llm.engine.runner
    cache_before = runner.kv_cache.clone()
    graphs = runner.capture_decode_graphs(8, llm.engine.max_model_len, record_step)
    assert torch.equal(runner.kv_cache, cache_before)
    assert graphs.buckets == (1, 2, 4, 8)
    assert _greedy(llm, prompts) == expected
    assert graphs.replays[8] >= NEW_TOKENS - 2  # the decode steps of all six at once
    assert graphs.eager_steps == 0


def test_steps_past_the_largest_bucket_run_eagerly() -> None:
    """Captured up to 2 rows: steps of 3 decodes run eagerly (counted), the rest replay, and
    the output is the eager engine's."""
    prompts = _prompts(3)
    expected = _greedy(_llm(), prompts)
    llm = _llm()
    graphs = llm.engine.runner.capture_decode_graphs(2, llm.engine.max_model_len, record_step)
    assert graphs.buckets == (1, 2)
    assert _greedy(llm, prompts) == expected
    assert graphs.eager_steps >= NEW_TOKENS - 2
    assert graphs.replays.total() == 0  # every decode step held three rows
    alone = _greedy(llm, prompts[:1])  # one request: the 1-row graph
    assert alone == expected[:1]
    # Its one-token prompt is a decode row too (a single-token sequence): every step replays.
    assert graphs.replays[1] == NEW_TOKENS


def test_replayed_logits_equal_eager_logits() -> None:
    """One decode step's logits from a replay (3 rows in the 4-row graph) against the same
    step run eagerly on the same cache."""
    llm = _llm()
    runner = llm.engine.runner
    graphs = runner.capture_decode_graphs(4, llm.engine.max_model_len, record_step)
    spans = [SequenceSpan(1, n, list(range(b, b + 3))) for n, b in ((5, 0), (20, 3), (33, 6))]
    batch = DecodeBatch([9, 10, 11], [4, 19, 32], spans, [0, 1, 2])
    cache = runner.kv_cache
    torch.manual_seed(0)
    cache.copy_(torch.randn_like(cache))
    replayed = graphs.run(batch)
    assert replayed is not None and replayed.shape == (3, SHAPES["tiny"].vocab_size)
    replayed = replayed.clone()
    metadata = runner.backend.prepare(spans, 3, BLOCK, torch.device("cpu"))
    eager = runner.model.forward(
        torch.tensor(batch.token_ids),
        torch.tensor(batch.positions),
        cache,
        runner.backend,
        metadata,
        torch.tensor(batch.logits_rows),
    )
    torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
    assert graphs.replays[4] == 1
    # Only some rows sampled: their rows of the bucket's logits, in order.
    picked = graphs.run(DecodeBatch(batch.token_ids, batch.positions, spans, [2, 0]))
    assert picked is not None
    torch.testing.assert_close(picked, eager[[2, 0]], rtol=1e-5, atol=1e-5)


def test_a_failed_capture_leaves_the_engine_serving_eagerly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A capture that fails after its first bucket (the largest) is captured: the engine logs
    it, keeps the error, replays nothing (not even the bucket captured) and its output is the
    eager engine's."""
    prompts = _prompts(3)
    expected = _greedy(_llm(), prompts)
    llm = _llm()
    captured: list[int] = []

    def capture_once(run):  # GraphCapture: the first capture works, the next one raises
        if captured:
            raise RuntimeError("operation not permitted when stream is capturing")
        captured.append(1)
        return record_step(run)

    with caplog.at_level("ERROR", logger="splitserve.engine.engine_core"):
        llm.engine._capture_or_serve_eagerly(4, capture_once)
    assert captured == [1]
    assert llm.engine.runner.decode_graphs is None
    assert llm.engine.graph_capture_error == (
        "RuntimeError: operation not permitted when stream is capturing"
    )
    assert "failed to capture; every step runs eagerly" in caplog.text
    assert _greedy(llm, prompts) == expected
