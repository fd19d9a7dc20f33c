"""Triton is optional: the kernel modules import without it, and on CPU the engine picks the
torch backend (float32, or when asked) or the C++ kernels' backend (bf16, where they build)."""

from __future__ import annotations

import subprocess
import sys

import torch

from splitserve.engine.config import EngineConfig, ModelConfig, RunnerConfig
from splitserve.engine.engine_core import _backend
from splitserve.kernels.attention import TorchAttentionBackend
from splitserve.kernels.cpu_attention import load_cpu_decode_attention
from splitserve.kernels.cpu_backend import CpuAttentionBackend

WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # `import triton` now raises ImportError
import torch
from splitserve.kernels import (
    activation, decode_attention, kv_pack, prefill_attention, rms_norm, rotary, store_kv,
)
from splitserve.kernels.triton_utils import HAS_TRITON, TritonUnavailableError
assert not HAS_TRITON
x = torch.randn(2, 8)
torch.testing.assert_close(activation.silu_and_mul_ref(x), activation.silu_and_mul_ref(x))
try:
    activation.silu_and_mul(x)
except TritonUnavailableError as error:
    assert "pip install triton" in str(error)
else:
    raise AssertionError("no error without triton")
try:
    from splitserve.kernels.triton_backend import TritonAttentionBackend
    TritonAttentionBackend()
except TritonUnavailableError:
    print("ok")
"""


def test_kernel_modules_import_without_triton() -> None:
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_TRITON], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_engine_picks_the_cpu_backends_on_cpu() -> None:
    # a float32 asked for by name: the torch reference backend (bit-exact with HF), never
    # Triton on a CPU
    named = EngineConfig(model=ModelConfig(dtype="float32"))
    assert type(_backend(named, torch.float32, 16)) is TorchAttentionBackend
    forced = EngineConfig(runner=RunnerConfig(attention_backend="torch"))
    assert type(_backend(forced, torch.bfloat16, 16)) is TorchAttentionBackend
    # bf16, and the float32 dtype="auto" serves in on a CPU without bf16: the C++ kernels
    # where they build, the torch backend otherwise
    expected = CpuAttentionBackend if load_cpu_decode_attention() else TorchAttentionBackend
    assert type(_backend(EngineConfig(), torch.bfloat16, 16)) is expected
    assert type(_backend(EngineConfig(), torch.float32, 16)) is expected
