"""The GPU paths' Triton kernels compile for sm_90 (H100/H200) on this CPU
(``bench/gpu/kernel_compile.py``), so a kernel change that would not build on the lent GPUs
fails here, not in a rare GPU call. Each check runs the tool's processes (the interpreter the
record phase needs is a per-process choice; compiling needs a process without it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "bench" / "gpu" / "kernel_compile.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=900, cwd=ROOT
    )


@pytest.mark.slow  # `make gpu-preflight`, run before every GPU call, compiles the same kernels
def test_every_gpu_kernel_compiles_for_sm90(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Llama-8B's layer in bf16 and float32: every kernel a decode or prompt step launches on
    CUDA recorded (``kernel_times.TRITON_KERNELS``, the GPU bench's list), each specialization
    compiled to a cubin within an sm_90 block's shared memory."""
    monkeypatch.syspath_prepend(str(TOOL.parent))
    from kernel_times import TRITON_KERNELS

    report_path = tmp_path / "report.json"
    result = _run("--shapes", "llama-8b", "--out", str(report_path))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads(report_path.read_text())
    kernels = report["kernels"]
    assert {entry["kernel"].split("(")[0] for entry in kernels} == set(TRITON_KERNELS)
    assert report["failures"] == 0
    for entry in kernels:
        assert entry["error"] is None and 0 <= entry["shared_bytes"] <= 232_448, entry
    described = [entry["kernel"] for entry in kernels]
    # The split decode (bf16: a 132-SM GPU's split counts) and the batch-invariant one.
    assert any("_decode_kernel(" in name and "SPLIT=True" in name for name in described)
    assert any("_decode_kernel(" in name and "PRECISION=ieee" in name for name in described)


def test_a_kernel_that_does_not_build_fails_the_check(tmp_path: Path) -> None:
    """A launch whose tile is not a power of two (tl.arange refuses it) is reported, named,
    and the check exits 1."""
    launches = tmp_path / "launches.json"
    signature = [["x_ptr", "*bf16"], ["out_ptr", "*bf16"], ["inter", "i32"]]
    signature += [["stride_x_row", "i32"], ["TILE", "constexpr"]]
    launch = {"module": "splitserve.kernels.activation", "kernel": "_silu_and_mul_kernel"}
    launch |= {"signature": signature, "constants": [["TILE", 1000]]}
    launches.write_text(json.dumps([launch]))
    result = _run("compile", "--launches", str(launches))
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["failures"] == 1
    [entry] = report["kernels"]
    assert entry["kernel"].startswith("_silu_and_mul_kernel(TILE=1000")
    assert "power of 2" in entry["error"] or "arange" in entry["error"], entry["error"]
