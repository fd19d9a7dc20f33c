"""What CPU this is, in one line, for every figure that depends on it (torch-free)."""

from __future__ import annotations

import platform
from pathlib import Path


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines()
    except OSError:
        return []


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as ``/proc/cpuinfo`` lists them (empty where unreadable)."""
    line = next((line for line in _cpuinfo() if line.startswith("flags")), "flags:")
    return frozenset(line.split(":", 1)[1].split())


def cpu_name() -> str:
    """``/proc/cpuinfo``'s model name, with ``amx_tile`` / ``avx512_bf16`` where the CPU has
    them (the two features that decide this project's kernels and rankings)."""
    model = next(
        (line.split(":", 1)[1].strip() for line in _cpuinfo() if "model name" in line),
        platform.processor() or platform.machine(),
    )
    flags = cpu_flags()
    features = [name for name in ("amx_tile", "avx512_bf16") if name in flags]
    if not features and "avx512f" not in flags:
        features = ["AVX2 only" if "avx2" in flags else "no AVX2"]
    return f"{model} ({', '.join(features) or 'no AMX, no AVX-512 BF16'})"
