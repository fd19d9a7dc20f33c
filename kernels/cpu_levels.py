"""The instruction-set levels the C++ CPU kernels are built for, and the one this CPU runs.

Each ``kernels/cpu/<source>.cpp`` is compiled at install time (``setup.py``: ``make install``,
``pip install``, the image's builder stage) once per level in ``LEVELS`` that builds it, into
``kernels/_cpu_<source>_<level><EXT_SUFFIX>``; at run time ``kernels/cpu_build.py`` loads, for
each source, the highest level built for it that this CPU runs (``running_level``), capped by
``SPLITSERVE_CPU_LEVEL``. Nothing is compiled on first use and nothing is built for
``-march=native``: a library built here runs on any CPU of its level.

On x86-64 the levels, lowest first (each runs the code of those below it):
  - ``avx2``: x86-64-v3 (AVX2, FMA, F16C, BMI2: Haswell, Zen 1-3). Float32 paths only.
  - ``avx512``: x86-64-v4 (AVX-512 F, BW, CD, DQ, VL: Skylake-SP, Cascade Lake).
  - ``avx512_bf16``: x86-64-v4 with AVX-512 BF16 and VNNI (Cooper Lake, Zen 4 and 5, Sapphire
    Rapids): the bf16 dot products.
  - ``amx``: avx512_bf16 with AMX tiles (Sapphire Rapids and later); only ``gemv.cpp`` has
    tiles, so the other sources run their ``avx512_bf16`` build there.
Elsewhere (aarch64 and other architectures) one ``generic`` level, the compiler's defaults.
A CPU below ``avx2`` (no AVX2 or no FMA) has no level: every kernel keeps the torch path.

This module imports only the standard library: ``setup.py`` reads it by path, before the
package (or torch) is installed.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

LEVEL_ENV = "SPLITSERVE_CPU_LEVEL"
"""Caps the level chosen (one of the level names below): e.g. ``avx2`` on an AVX-512 machine
runs and measures the AVX2 kernels as an AVX2-only CPU would."""

_COMMON_FLAGS = ("-O3", "-fopenmp", "-std=c++17")


@dataclass(frozen=True)
class CpuLevel:
    """One build of the kernels: its compiler flags and the ``/proc/cpuinfo`` flags a CPU
    needs to run it."""

    name: str
    compile_flags: tuple[str, ...]
    cpu_flags: frozenset[str]
    sources: frozenset[str] | None = None
    """The sources built at this level; None: every source."""

    def builds(self, source: str) -> bool:
        """Whether ``kernels/cpu/<source>.cpp`` is built at this level."""
        return self.sources is None or source in self.sources


_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_BF16 = _V4 | {"avx512_bf16", "avx512_vnni"}
X86_LEVELS = (
    CpuLevel("avx2", (*_COMMON_FLAGS, "-march=x86-64-v3"), _V3),
    CpuLevel("avx512", (*_COMMON_FLAGS, "-march=x86-64-v4"), _V4),
    CpuLevel(
        "avx512_bf16", (*_COMMON_FLAGS, "-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"), _BF16
    ),
    CpuLevel(
        "amx",
        (
            *_COMMON_FLAGS,
            "-march=x86-64-v4",
            "-mavx512bf16",
            "-mavx512vnni",
            "-mamx-tile",
            "-mamx-bf16",
        ),
        _BF16 | {"amx_tile", "amx_bf16"},
        sources=frozenset({"gemv"}),
    ),
)
GENERIC_LEVELS = (CpuLevel("generic", _COMMON_FLAGS, frozenset()),)


def is_x86_64(machine: str | None = None) -> bool:
    """Whether ``machine`` (default: this one's ``platform.machine()``) is x86-64."""
    return (machine or platform.machine()).lower() in ("x86_64", "amd64")


def levels(machine: str | None = None) -> tuple[CpuLevel, ...]:
    """The levels built for ``machine``'s architecture (default: this one's), lowest first."""
    return X86_LEVELS if is_x86_64(machine) else GENERIC_LEVELS


def level_named(name: str) -> CpuLevel:
    """The level called ``name``; ``ValueError`` naming the known ones otherwise."""
    for level in levels():
        if level.name == name:
            return level
    known = ", ".join(level.name for level in levels())
    raise ValueError(f"unknown CPU kernel level {name!r} (known here: {known})")


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as ``/proc/cpuinfo`` lists them (empty where unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_model_name() -> str:
    """``/proc/cpuinfo``'s model name (what ``lscpu`` prints), or the machine's type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def runnable_levels(flags: frozenset[str] | None = None) -> tuple[CpuLevel, ...]:
    """The levels a CPU with ``flags`` (default: this one's) executes, lowest first: its
    highest and every one below it (an AVX-512 CPU runs AVX2 code). Not capped."""
    if not is_x86_64():
        return GENERIC_LEVELS
    flags = cpu_flags() if flags is None else flags
    return tuple(level for level in X86_LEVELS if level.cpu_flags <= flags)


def level_cap() -> CpuLevel | None:
    """The level ``SPLITSERVE_CPU_LEVEL`` names, None when unset; ``ValueError`` for a name
    that is no level."""
    value = os.environ.get(LEVEL_ENV, "").strip().lower()
    return level_named(value) if value else None


def running_level(flags: frozenset[str] | None = None) -> CpuLevel | None:
    """The highest level this CPU runs, capped by ``SPLITSERVE_CPU_LEVEL``; None when it runs
    none (a CPU without AVX2 and FMA), or the cap is below all it runs."""
    runnable = runnable_levels(flags)
    cap = level_cap()
    if cap is not None:
        order = [level.name for level in levels()]
        runnable = tuple(
            level for level in runnable if order.index(level.name) <= order.index(cap.name)
        )
    return runnable[-1] if runnable else None


def level_for(source: str, flags: frozenset[str] | None = None) -> CpuLevel | None:
    """The level ``source``'s library is loaded at here: the highest that builds it among
    those ``running_level`` allows; None when there is none."""
    top = running_level(flags)
    if top is None:
        return None
    order = [level.name for level in levels()]
    allowed = [level for level in levels() if order.index(level.name) <= order.index(top.name)]
    built = [level for level in allowed if level.builds(source)]
    return built[-1] if built else None


def cpu_has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether the kernels run a bf16 level here (AVX-512 BF16 or AMX, within the cap): where
    ``--dtype auto`` picks bf16."""
    level = running_level(flags)
    return level is not None and level.name in ("avx512_bf16", "amx")
