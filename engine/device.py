"""Device and dtype selection for the model runner."""

from __future__ import annotations

import torch

from splitserve.common.cpu_info import cpu_flags, cpu_name
from splitserve.common.errors import InvalidRequestError
from splitserve.kernels.cpu_build import cpu_has_native_bf16

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BF16_CPU_FLAGS = ("avx512bw", "avx512vl", "avx512dq")
"""What oneDNN's bf16 linear needs of an x86 CPU (or ``avx_ne_convert`` instead)."""


def cpu_bf16_refusal() -> str | None:
    """Why ``--dtype bfloat16`` cannot run on this CPU, None where it can: torch's oneDNN
    computes bf16 linears only on CPUs with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT (its own
    check, which ``ONEDNN_MAX_CPU_ISA`` caps too); on others (AVX2-only CPUs such as Zen 3
    EPYCs) the first linear would die with oneDNN's internal message."""
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    flags = cpu_flags()
    missing = [flag for flag in BF16_CPU_FLAGS if flag not in flags]
    has = "its flags lack " + ", ".join(missing) if missing else "oneDNN is capped below it"
    return (
        f"--dtype bfloat16 needs a CPU with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; this one "
        f"({cpu_name()}: {has}) cannot compute bf16: use --dtype float32 or auto "
        "(auto serves float32 here, reading quantized weights as stored)"
    )


def dtype_refusal(name: str, device_type: str, computes: bool = True) -> str | None:
    """Why an engine cannot compute in dtype ``name`` on ``device_type``, None where it can:
    bfloat16 on a CPU that cannot compute it (``cpu_bf16_refusal``); an engine that
    ``computes`` nothing (a simulated one) takes any dtype."""
    if name == "bfloat16" and device_type == "cpu" and computes:
        return cpu_bf16_refusal()
    return None


def resolve_dtype(name: str, device: torch.device, computes: bool = True) -> torch.dtype:
    """Map a config dtype name to a torch dtype; "auto" prefers bf16 where it is native.
    ``InvalidRequestError`` where ``dtype_refusal`` says why it cannot be computed."""
    reason = dtype_refusal(name, device.type, computes)
    if reason is not None:
        raise InvalidRequestError(reason, param="dtype")
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
