"""``bench/gpu/serve_goodput.py``, the GPU serving goodput benchmark, without a GPU: its CPU
variant end to end (``--cpu-tiny``: ``splitserve up --model random:tiny``, both workloads at
three rates) and its bookkeeping: every request completed or failed with a reason."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from splitserve.client import Chunk, ClientError, Finish
from splitserve.client.types import Usage

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"


@pytest.fixture
def bench_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmark's modules import as its scripts do (``bench/`` and ``bench/gpu/``)."""
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.syspath_prepend(str(BENCH / "gpu"))


class FakeClient:
    """Prompt 1 token: completes; 2: refused; 3: one token, then silence."""

    async def stream(self, *, token_ids, sampling) -> AsyncIterator[Chunk | Finish]:
        usage = Usage(len(token_ids), 1, 0)
        if token_ids[0] == 2:
            raise ClientError(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        yield Chunk("r", "t7", (7,), (), usage)
        if token_ids[0] == 3:
            await asyncio.sleep(60)
        yield Finish("r", "length", None, usage)


def test_a_window_accounts_for_every_request(bench_modules: None) -> None:
    from goodput_report import failure_reasons
    from rate_window import UNFINISHED, run_window
    from workload import RequestSpec

    requests = [RequestSpec(i, 0.01 * i, (first, 9), 1) for i, first in enumerate((1, 2, 3, 1))]
    records = asyncio.run(run_window(FakeClient(), requests, deadline_s=0.5))  # type: ignore[arg-type]
    assert [record.completed for record in records] == [True, False, False, True]
    assert failure_reasons(records) == {"RESOURCE_EXHAUSTED: queue full": 1, UNFINISHED: 1}
    assert all(record.end_time >= record.send_time > 0 for record in records)
    assert len(records[2].token_times) == 1  # what arrived before the cut is kept


def test_decode_steps_against_the_hbm_bound(bench_modules: None) -> None:
    from decode_steps import DecodeVsBound, StepCounters

    window = StepCounters(110, 900, 2.5, ahead=90).minus(StepCounters(10, 100, 0.5, ahead=10))
    figures = DecodeVsBound.of(window, bound_step_ms=4.0)
    assert (figures.decode_steps, figures.decode_batch_mean) == (100, 8.0)
    assert figures.decode_step_ms_mean == 20.0
    assert figures.decode_tok_per_s_in_steps == 400.0
    assert figures.hbm_bound_tok_per_s == 2000.0  # 8 rows per 4 ms
    assert figures.fraction_of_hbm_bound == 0.2
    assert figures.steps_ahead_fraction == 0.8  # 80 of the window's 100 steps went ahead
    assert DecodeVsBound.of(window, None).fraction_of_hbm_bound is None


def assert_cpu_variant_report(report: dict) -> None:
    """What ``serve_goodput.py --cpu-tiny`` must report: every rate of both workloads run, each
    request completed or counted failed with its reason, the SLO stated, the cluster stopped
    cleanly (also checked on the dry run's summary, ``tests/test_gpu_script.py``)."""
    assert report["model"] == "random:tiny" and report["device"] == "cpu"
    assert report["slo"]["ttft_ms"] == 1000.0 and report["slo"]["mean_itl_ms"] == 30.0
    assert report["bounds"] == {"skipped": "no CUDA device asked for (--device cpu)"}
    assert report["cluster_stopped_cleanly"] is True and report["error"] is None
    assert [w["name"] for w in report["workloads"]] == ["chat", "long"]
    for workload in report["workloads"]:
        assert [rate["rate"] for rate in workload["rates"]] == (
            [2.0, 4.0, 8.0] if workload["name"] == "chat" else [1.0, 2.0, 4.0]
        )
        for rate in workload["rates"]:
            assert rate["requests"] >= 1
            assert rate["completed"] + sum(rate["failures"].values()) == rate["requests"]
            assert rate["failed"] == sum(rate["failures"].values())
            assert set(rate["ttft_ms"]) == set(rate["itl_ms"]) == {"p50", "p90", "p99"}
            assert rate["goodput_req_per_s"] <= rate["request_per_s"]
            assert rate["engine"]["decode_steps"] > 0 or not rate["completed"]
        assert workload["rates"][0]["completed"] > 0


@pytest.mark.slow  # the default suite's dry run of bench/gpu/run.sh runs the same variant
@pytest.mark.timeout(150)
def test_the_cpu_variant_runs_every_rate_and_loses_no_request(tmp_path: Path) -> None:
    out = tmp_path / "serve_goodput.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(BENCH), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, str(BENCH / "gpu/serve_goodput.py"), "--cpu-tiny", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=140,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert_cpu_variant_report(json.loads(out.read_text()))
    assert (tmp_path / "serve_goodput.cluster.log").exists()
