"""What CPU this is, in one line, for every figure that depends on it (torch-free)."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_name() -> str:
    """``/proc/cpuinfo``'s model name, with ``amx_tile`` / ``avx512_bf16`` where the CPU has
    them (the two features that decide this project's kernels and rankings)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        text = ""
    model = next(
        (line.split(":", 1)[1].strip() for line in text.splitlines() if "model name" in line),
        platform.processor() or platform.machine(),
    )
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "").split()
    features = [name for name in ("amx_tile", "avx512_bf16") if name in flags]
    return f"{model} ({', '.join(features) or 'no AMX, no AVX-512 BF16'})"
