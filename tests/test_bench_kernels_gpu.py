"""``bench/bench_kernels_gpu.py``'s sampler bench run on the CPU with a small vocabulary, so
the one prepared GPU call does not meet its first error: it gives one entry per batch and
logit shape, in which the wait-free choice (a step launched ahead) picked every row's token
as the choice read on the host did."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _wall_ms(run: Callable[[], object]) -> float:
    started = time.perf_counter()
    run()
    return (time.perf_counter() - started) * 1e3


def test_the_top_p_choice_bench_runs_and_both_choices_agree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_kernels_gpu

    results = bench_kernels_gpu.bench_top_p_choice("cpu", 3000, (1, 5), _wall_ms)
    assert [(r["batch"], r["logits"]) for r in results] == [
        (1, "peaked"),
        (1, "flat"),
        (5, "peaked"),
        (5, "flat"),
    ]
    assert all(r["same"] is True for r in results), results
    assert all(r["read_ms"] > 0 and r["wait_free_ms"] > 0 for r in results), results
