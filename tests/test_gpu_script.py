"""``bench/gpu/run.sh`` in its dry mode: everything that needs CUDA skipped, the rest run, so
the script a lent GPU machine runs cannot rot between loans (bench/gpu/README.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_serve_goodput import assert_cpu_variant_report

REPO = Path(__file__).resolve().parent.parent
GPU_IMAGE_SITE = Path(__file__).resolve().parent / "gpu_image"
"""Its sitecustomize makes the interpreters of the dry run lack what the GPU image lacks."""


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is for machines without CUDA")
def test_dry_run_writes_every_step_and_skips_what_needs_cuda(tmp_path: Path) -> None:
    """The whole script as a lent machine runs it, minus what needs CUDA, in interpreters that
    lack what the GPU image lacks (``tests/gpu_image``); its serving goodput step runs its CPU
    variant (``assert_cpu_variant_report``)."""
    out = tmp_path / "gpu"
    path = os.pathsep.join(filter(None, [str(GPU_IMAGE_SITE), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": path}
    result = subprocess.run(
        ["bash", str(REPO / "bench/gpu/run.sh"), str(out), "--dry"],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    log = (out / "run.log").read_text()
    assert result.returncode == 0, log
    summary = json.loads((out / "gpu-run.json").read_text())
    assert summary["dry"] is True
    statuses = {step["name"]: step["status"] for step in summary["steps"]}
    # The carried packages (make gpu-site) are listed and unpacked where they were built.
    carried = (REPO / ".gpu-site.tar.xz").exists()
    assert statuses == {
        "site": "passed" if carried else "skipped: dry mode, no .gpu-site.tar.xz",
        "gpu-tests": "passed",
        "kv-transfer": "passed",
        "kernel-bench": "skipped: dry mode",
        "step-times": "passed",
        "serve-goodput": "passed",  # its CPU variant (tests/test_serve_goodput.py checks it)
    }
    tests = summary["gpu_tests"]
    # Every gpu-marked test was collected (none failed to import) and skipped for want of CUDA.
    assert tests["failed"] == 0 and tests["passed"] == 0
    assert tests["skipped"] >= 40
    assert tests["skip_reasons"] == ["needs a CUDA device"]
    assert summary["kv_transfer"] == {"skipped": "no CUDA device"}
    assert summary["step_times"] == {"skipped": "no CUDA device"}
    assert summary["kernel_bench"] == {"missing": "kernel_bench.json"}
    assert_cpu_variant_report(summary["serve_goodput"])
    assert "splitserve from" in log
    assert ("every link resolves" in log) is carried


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_serving_check_passes_on_the_cpu(tmp_path: Path) -> None:
    """``bench/gpu/serve.sh`` as a lent GPU machine runs it, on the CPU: the cluster's float32
    greedy completions of a random-weight model equal the in-process engine's."""
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", str(REPO / "bench/gpu/serve.sh"), str(tmp_path), "cpu"],
        env=env, capture_output=True, text=True, timeout=580,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "serve_check.json").read_text())
    assert report["equal_to_in_process"] == [True, True, True]
    assert report["cluster_stopped_cleanly"] is True
    assert report["kv_bytes_received"] > 0  # every prompt's KV crossed processes


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is for machines without CUDA")
def test_steps_past_the_budget_are_skipped_saying_so(tmp_path: Path) -> None:
    """With no time left in RUN_BUDGET_S every step is skipped, named, and the summary still
    written: a lent machine's call ends with its results, not killed mid-step."""
    out = tmp_path / "gpu"
    env = {**os.environ, "PYTHON": sys.executable, "RUN_BUDGET_S": "25"}
    result = subprocess.run(
        ["bash", str(REPO / "bench/gpu/run.sh"), str(out), "--dry"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, (out / "run.log").read_text()
    summary = json.loads((out / "gpu-run.json").read_text())
    ran = [step for step in summary["steps"] if step["name"] != "site"]
    assert [step["name"] for step in ran] == [
        "gpu-tests", "kv-transfer", "kernel-bench", "step-times", "serve-goodput",
    ]  # fmt: skip
    for step in ran:
        assert step["status"].startswith("skipped: out of time") or (
            step["name"] == "kernel-bench" and step["status"] == "skipped: dry mode"
        ), step
