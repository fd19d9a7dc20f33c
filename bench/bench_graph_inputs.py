"""Host cost of filling a replayed decode step's buffers (``engine/decode_graphs.py``).

Times ``StaticDecodeInputs.fill`` (token ids, positions, slots, lengths and block tables, the
tables from per-request mirrors that copy only appended blocks) against the baseline measured
in the same run: the eager path's block tables alone, built from Python lists each step
(``kernels/triton_backend.py:padded_tables``). Steady state of a decode batch: the same
requests every step, each table grown by at most a block. CPU tensors (the host side; on CUDA
one more copy to the device, the same for both). Prints medians of ``--reps`` in ms.

    python bench/bench_graph_inputs.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from splitserve.common.blocks import blocks_for_tokens
from splitserve.common.cpu_info import cpu_name
from splitserve.engine.decode_graphs import DecodeBatch, StaticDecodeInputs
from splitserve.kernels.attention import SequenceSpan
from splitserve.kernels.triton_backend import padded_tables

BLOCK = 16
SHAPES = ((1, 525), (64, 525), (64, 4096), (256, 8192))
"""(rows, context tokens) per case."""


def median_ms(run: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    print(f"cpu: {cpu_name()}, torch {torch.__version__}")
    max_rows = max(rows for rows, _ in SHAPES)
    max_blocks = max(blocks_for_tokens(tokens, BLOCK) for _, tokens in SHAPES)
    for rows, tokens in SHAPES:
        blocks = blocks_for_tokens(tokens, BLOCK)
        spans = [
            SequenceSpan(1, tokens, list(range(i * blocks, (i + 1) * blocks))) for i in range(rows)
        ]
        batch = DecodeBatch(list(range(rows)), [tokens - 1] * rows, spans, list(range(rows)))
        inputs = StaticDecodeInputs(max_rows, max_blocks, BLOCK, torch.device("cpu"))
        fill = median_ms(lambda: inputs.fill(batch, rows), args.reps)  # noqa: B023
        lists = median_ms(
            lambda: padded_tables(spans, BLOCK, torch.device("cpu")),  # noqa: B023
            args.reps,
        )
        print(
            f"{rows:4d} rows x {tokens:5d} tokens: fill {fill:.3f} ms, "
            f"list-built tables alone {lists:.3f} ms ({lists / fill:.1f}x)"
        )


if __name__ == "__main__":
    main()
