"""Decode steps replayed from CUDA graphs, one graph captured per batch-size bucket.

A decode step of the model on a GPU is some 400-500 small kernels launched from Python (per
layer: norms, projections, rotary, the KV store, attention, the MLP); at small batches the
launches, not the memory, set its time. ``DecodeGraphs`` captures the model's forward over a
decode-only batch once per *bucket* (a batch size, ``graph_buckets``) and replays it: one
launch of the whole step, no Python per kernel.

Contract:

- Eligible steps (``DecodeGraphs.run``): every row a decode row (a single-token sequence: a
  generated token, a draft verified as its own decode row, or a one-token prompt), at most
  the largest bucket's rows, each row's context within the buffers' tables (``max_blocks``,
  the engine's context window). ``run`` returns None for anything else and the caller runs
  the step eagerly: prompt chunks and mixed steps, a larger batch, a longer context.
- Static buffers (``StaticDecodeInputs``), allocated once for the largest bucket: token ids,
  positions, KV slots and context lengths ``[max_rows]``, block tables
  ``[max_rows, max_blocks]`` and the logits rows ``[max_rows]`` (0, 1, 2, ...). A step of
  ``rows`` fills their first ``rows`` and pads the bucket's rest as empty sequences (token 0,
  position 0, slot -1: stores nothing; length 0: attends to nothing, its output row is
  ignored). A table row's columns past its context keep what they held: the kernels read a
  row's table only below its length. The block tables are built on the host from a mirror of
  each request's table (``BlockTableMirror``) that copies only the blocks appended since the
  last step, so a step costs a memcpy a row, not a Python int per block (256 rows of 8,192-token
  contexts: 131,072 ints a step).
- What a graph holds: the forward over the bucket's leading rows of the buffers, with
  attention metadata that depends on the bucket only (``graph_decode_metadata`` of the
  backend): float32 logits of every row of the bucket ``[bucket, vocab]`` in a tensor the
  graph owns. ``run`` returns the step's logits rows of it, valid until the next replay (the
  runner samples from them at once, on the same stream).
- Capture (``CudaGraphCapture``): largest bucket first, every graph in one memory pool, each
  after warm-up runs (Triton compiles the bucket's kernels then, not inside the capture).
  Off CUDA, ``record_step`` stands in for the graph: a replay reruns the captured closure and
  writes its result into the tensor the capture returned, so what a replay reads (only the
  buffers) and writes (only that tensor) is what a CUDA replay would, which the CPU tests check.

Numerics: a graph computes the step as the eager path does (the same kernels; with a batch-
invariant backend the same attention splits and tiles), except that projections see the
bucket's padded row count, so a library may pick another matmul algorithm than for the unpadded
batch: float32 greedy output is compared with eager and the CPU engine on the GPU
(``tests/test_gpu_engine.py``).
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from splitserve.common.blocks import blocks_for_tokens
from splitserve.engine.host_copies import staged, to_device
from splitserve.kernels.attention import SequenceSpan

GRAPH_BUCKET_STRIDES = ((64, 8), (128, 16), (256, 32))
"""Above 8 rows, buckets every 8 rows up to 64, every 16 up to 128, every 32 up to 256, every
64 beyond: a step of more than 8 rows pads fewer rows than the stride where it falls (at most 7
padding rows up to 64, which at batch sizes this small cost little more than the weights' read
every step makes anyway)."""
WIDE_STRIDE = 64
PADDING_ROW = (0, 0, -1, 0)
"""Token, position, KV slot and context length of a padding row."""


def graph_buckets(max_rows: int) -> tuple[int, ...]:
    """Batch sizes to capture for decode steps of up to ``max_rows`` rows: 1, 2, 4, 8, then
    ``GRAPH_BUCKET_STRIDES`` apart, and ``max_rows`` itself last, so every size up to it has
    a bucket."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_rows:
        last = sizes[-1]
        stride = next((s for limit, s in GRAPH_BUCKET_STRIDES if last < limit), WIDE_STRIDE)
        sizes.append(last + stride)
    return (*[size for size in sizes if size < max_rows], max_rows)


def bucket_for(rows: int, buckets: Sequence[int]) -> int | None:
    """The smallest of the ascending ``buckets`` holding ``rows``; None for 0 rows or past the
    largest."""
    if rows < 1:
        return None
    index = bisect.bisect_left(buckets, rows)
    return buckets[index] if index < len(buckets) else None


@dataclass(frozen=True)
class DecodeBatch:
    """One decode-only step's rows as the runner packs them: row ``i`` is token
    ``token_ids[i]`` at ``positions[i]``, the single new token of ``spans[i]`` (``query_len``
    1); ``logits_rows`` are the rows sampled, in the sampler's order."""

    token_ids: Sequence[int]
    positions: Sequence[int]
    spans: Sequence[SequenceSpan]
    logits_rows: Sequence[int]

    @property
    def rows(self) -> int:
        return len(self.token_ids)


class _MirroredTable:
    """One request's table as an int32 array: ``blocks[:copied]`` equal ``source[:copied]``."""

    __slots__ = ("source", "blocks", "copied")

    def __init__(self, source: Sequence[int], capacity: int) -> None:
        self.source = source  # held, so its id is not reused while mirrored
        self.blocks = np.zeros(capacity, dtype=np.int32)
        self.copied = 0


class BlockTableMirror:
    """The host side of the decode steps' block tables, rebuilt each step from per-request
    mirrors (module docstring: Static buffers).

    Invariant it relies on (``KVCacheManager``): a request's table is one list object for as
    long as the request holds blocks, and only ever grows at its end (``allocate`` extends it;
    ``free`` drops the list, and a later allocation makes a new one). So the blocks below a
    mirror's ``copied`` never change while its list lives, and each step copies only the ones
    appended since. As a guard, a list that got shorter or whose last mirrored block changed is
    mirrored afresh (a rewrite elsewhere in the list would not be seen: the invariant is what
    makes the mirror right). Mirrors of tables the latest ``fill`` did not use are dropped."""

    def __init__(self, max_rows: int, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.tables = np.zeros((max_rows, max_blocks), dtype=np.int32)
        self._mirrors: dict[int, _MirroredTable] = {}

    def fill(self, tables: Sequence[Sequence[int]], widths: Sequence[int]) -> int:
        """Rows ``0..len(tables)`` of ``self.tables`` hold each table's first ``widths[i]``
        blocks; returns the widest width (the columns a step's copy must carry)."""
        mirrors: dict[int, _MirroredTable] = {}
        for row, (table, width) in enumerate(zip(tables, widths, strict=True)):
            mirror = mirrors.get(id(table)) or self._mirror(table)
            mirrors[id(table)] = mirror
            self.tables[row, :width] = mirror.blocks[:width]
        self._mirrors = mirrors
        return max(widths, default=0)

    def _mirror(self, table: Sequence[int]) -> _MirroredTable:
        """The table's mirror, brought up to its current length."""
        mirror = self._mirrors.get(id(table))
        copied = mirror.copied if mirror is not None else 0
        if (
            mirror is None
            or mirror.source is not table
            or len(table) < copied
            or (copied and table[copied - 1] != mirror.blocks[copied - 1])
        ):
            mirror, copied = _MirroredTable(table, self.max_blocks), 0
        length = min(len(table), self.max_blocks)
        if length > copied:
            mirror.blocks[copied:length] = table[copied:length]
            mirror.copied = length
        return mirror


class StaticDecodeInputs:
    """The buffers every captured graph reads (module docstring: Static buffers)."""

    def __init__(
        self, max_rows: int, max_blocks: int, block_size: int, device: torch.device
    ) -> None:
        self.max_rows = max_rows
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self._rows = torch.zeros(4, max_rows, dtype=torch.int64, device=device)
        """[4, max_rows]: token ids, positions, KV slots, context lengths (one copy fills all)."""
        self.block_tables = torch.zeros(max_rows, max_blocks, dtype=torch.int32, device=device)
        self._host_tables = BlockTableMirror(max_rows, max_blocks)
        self.logits_rows = torch.arange(max_rows, dtype=torch.int64, device=device)

    @property
    def token_ids(self) -> torch.Tensor:  # [max_rows] int64
        return self._rows[0]

    @property
    def positions(self) -> torch.Tensor:  # [max_rows] int64
        return self._rows[1]

    @property
    def slot_mapping(self) -> torch.Tensor:  # [max_rows] int64, -1 on padding rows
        return self._rows[2]

    @property
    def seq_lens(self) -> torch.Tensor:  # [max_rows] int64, 0 on padding rows
        return self._rows[3]

    def fits(self, batch: DecodeBatch) -> bool:
        """Whether every row is a decode whose context the tables hold."""
        capacity = self.max_blocks * self.block_size
        return batch.rows <= self.max_rows and all(
            span.query_len == 1 and span.context_len <= capacity for span in batch.spans
        )

    def fill(self, batch: DecodeBatch, bucket: int, token_ids: torch.Tensor | None = None) -> None:
        """Write ``batch`` into the first rows and padding rows up to ``bucket``; ``token_ids``
        (``[k]`` int64 on the device, a step's choices not yet read by the host) replace the
        first ``k`` of ``batch.token_ids``. Queued on the current stream without waiting for
        the device (host values staged in pinned memory, ``engine/host_copies.py``), so it
        may run while an earlier replay does."""
        if not batch.rows <= bucket <= self.max_rows:
            raise ValueError(f"a batch of {batch.rows} rows does not fill a bucket of {bucket}")
        size, pad = self.block_size, bucket - batch.rows
        slots = [slot for span in batch.spans for slot in span.new_slots(size)]  # one a row
        lengths = [span.context_len for span in batch.spans]
        pad_token, pad_position, pad_slot, pad_length = PADDING_ROW
        rows = torch.tensor(
            [
                [*batch.token_ids, *[pad_token] * pad],
                [*batch.positions, *[pad_position] * pad],
                [*slots, *[pad_slot] * pad],
                [*lengths, *[pad_length] * pad],
            ],
            dtype=torch.int64,
        )  # [4, bucket]
        self._rows[:, :bucket].copy_(staged(rows, self.device), non_blocking=True)
        if token_ids is not None:  # after the rows' copy, on the stream
            self._rows[0, : token_ids.shape[0]].copy_(token_ids)
        widths = [blocks_for_tokens(length, size) for length in lengths]
        mirror = self._host_tables
        width = mirror.fill([span.block_table for span in batch.spans], widths)
        if width:
            tables = torch.from_numpy(mirror.tables[: batch.rows, :width])  # [rows, width]
            tables = staged(tables, self.device)
            self.block_tables[: batch.rows, :width].copy_(tables, non_blocking=True)

    def pad(self, bucket: int) -> None:
        """Every row up to ``bucket`` a padding row (the state graphs are captured in)."""
        for index, value in enumerate(PADDING_ROW):
            self._rows[index, :bucket].fill_(value)


class StepGraph(Protocol):
    """A captured step: ``replay`` recomputes its output tensor from the buffers."""

    def replay(self) -> None: ...


GraphCapture = Callable[[Callable[[], torch.Tensor]], tuple[StepGraph, torch.Tensor]]
"""Captures ``run`` (a closure over the buffers) as a graph and the output tensor it rewrites."""


class CudaGraphCapture:
    """Captures with ``torch.cuda.CUDAGraph``, every graph in one memory pool (buckets are
    replayed one at a time, so their intermediates can share memory), each after
    ``WARMUP_RUNS`` runs on a side stream."""

    WARMUP_RUNS = 2

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._pool = torch.cuda.graph_pool_handle()

    def __call__(self, run: Callable[[], torch.Tensor]) -> tuple[StepGraph, torch.Tensor]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.WARMUP_RUNS):
                run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls meanwhile (UCX's progress thread moving KV
        # on its own streams) do not invalidate the capture; only this thread's would.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            output = run()
        return graph, output


class RecordedStep:
    """Stands in for a CUDA graph off CUDA: ``replay`` reruns the closure and writes its
    result into ``output``, the tensor the capture returned, as a graph's replay rewrites the
    tensors it captured."""

    def __init__(self, run: Callable[[], torch.Tensor]) -> None:
        self._run = run
        self.output = run()

    @torch.inference_mode()
    def replay(self) -> None:  # the output is an inference tensor, as the forward made it
        self.output.copy_(self._run())


def record_step(run: Callable[[], torch.Tensor]) -> tuple[StepGraph, torch.Tensor]:
    """``GraphCapture`` off CUDA (``RecordedStep``)."""
    step = RecordedStep(run)
    return step, step.output


@dataclass(frozen=True)
class _Captured:
    graph: StepGraph
    logits: torch.Tensor  # [bucket, vocab] float32, rewritten by each replay


class DecodeGraphs:
    """The captured decode steps of one model runner (module docstring: Contract)."""

    def __init__(
        self,
        forward: Callable[[int], torch.Tensor],
        inputs: StaticDecodeInputs,
        buckets: Sequence[int],
        capture: GraphCapture,
    ) -> None:
        """Captures ``forward(bucket)`` (the model over the buffers' first ``bucket`` rows;
        float32 logits ``[bucket, vocab]``) for every bucket, largest first."""
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[-1] > inputs.max_rows:
            raise ValueError(f"buckets must ascend within {inputs.max_rows} rows: {buckets}")
        self.inputs = inputs
        self.buckets = tuple(buckets)
        self.replays: Counter[int] = Counter()
        """Replays per bucket."""
        self.eager_steps = 0
        """Decode-only steps ``run`` turned down (too many rows, a context past the tables)."""
        started = time.perf_counter()
        self._graphs: dict[int, _Captured] = {}
        for bucket in sorted(self.buckets, reverse=True):
            inputs.pad(bucket)
            graph, logits = capture(lambda bucket=bucket: forward(bucket))
            self._graphs[bucket] = _Captured(graph, logits)
        self.capture_s = time.perf_counter() - started

    def bucket_of(self, batch: DecodeBatch) -> int | None:
        """The bucket whose graph replays ``batch``: the smallest holding its rows, where the
        buffers hold its contexts; None where no graph does."""
        bucket = bucket_for(batch.rows, self.buckets)
        return bucket if bucket is not None and self.inputs.fits(batch) else None

    def run(self, batch: DecodeBatch) -> torch.Tensor | None:
        """``replay`` in ``batch``'s bucket; None where no graph replays it (``bucket_of``:
        counted in ``eager_steps``, the caller runs it eagerly)."""
        bucket = self.bucket_of(batch)
        if bucket is None:
            self.eager_steps += 1
            return None
        return self.replay(batch, bucket)

    def replay(
        self, batch: DecodeBatch, bucket: int, token_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Float32 logits ``[len(batch.logits_rows), vocab]`` of ``batch`` replayed from the
        graph of ``bucket`` (its ``bucket_of``), valid until the next replay. ``token_ids``:
        as ``StaticDecodeInputs.fill`` takes them. Nothing here waits for the device."""
        self.inputs.fill(batch, bucket, token_ids)
        captured = self._graphs[bucket]
        captured.graph.replay()
        self.replays[bucket] += 1
        rows = list(batch.logits_rows)
        if rows == list(range(len(rows))):
            return captured.logits[: len(rows)]
        return captured.logits[to_device(rows, torch.int64, self.inputs.device)]
