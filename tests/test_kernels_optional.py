"""Triton is optional: the kernel modules import without it, and the engine picks the torch
attention backend on CPU."""

from __future__ import annotations

import subprocess
import sys

from splitserve.engine.attention import TorchAttentionBackend
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine_core import _backend

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


def test_engine_picks_torch_backend_on_cpu() -> None:
    assert isinstance(_backend(EngineConfig(), batch_invariant=False), TorchAttentionBackend)
