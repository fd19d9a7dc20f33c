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

This module is the table only and imports only the standard library: ``setup.py`` reads it by
path, before the package (or torch) is installed. Which level runs here is
``kernels/cpu_build.py``'s.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

LEVEL_ENV = "SPLITSERVE_CPU_LEVEL"
"""Caps the level chosen (one of the level names below): e.g. ``avx2`` on an AVX-512 machine
runs and measures the AVX2 kernels as an AVX2-only CPU would."""

SOURCE_NAMES = (
    "decode_layers",
    "fused_ops",
    "gemv",
    "paged_decode_attention",
    "prefill_attention",
    "qgemv",
    "sampling",
)
"""The kernel sources, ``kernels/cpu/<name>.cpp``: each is one library per level."""

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
    computes_bf16: bool = False
    """Whether its kernels compute bf16 (dot products on bf16 pairs): where ``--dtype auto``
    serves bf16."""

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
        "avx512_bf16",
        (*_COMMON_FLAGS, "-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
        _BF16,
        computes_bf16=True,
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
        computes_bf16=True,
    ),
)
GENERIC_LEVELS = (CpuLevel("generic", _COMMON_FLAGS, frozenset()),)


def library_module(source: str, level: CpuLevel) -> str:
    """The module name of ``source``'s library at ``level`` in the ``splitserve.kernels``
    package (``setup.py`` builds it, ``cpu_build.library_path`` finds it)."""
    return f"_cpu_{source}_{level.name}"


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
