"""The CPU kernel levels a test runs a kernel at: every level built for this architecture, each
skipped only where this CPU cannot execute it (an AVX-512 machine runs the AVX2 level too, so
every CI run covers it)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest

from splitserve.kernels.cpu_attention import load_cpu_decode_attention, load_cpu_prefill_attention
from splitserve.kernels.cpu_build import runnable_levels
from splitserve.kernels.cpu_decode_layers import load_decode_layers_library
from splitserve.kernels.cpu_fused_ops import load_cpu_fused_ops
from splitserve.kernels.cpu_gemv import load_cpu_gemv
from splitserve.kernels.cpu_levels import LEVEL_ENV, levels
from splitserve.kernels.cpu_qgemv import load_cpu_qgemv
from splitserve.kernels.cpu_sampling import load_cpu_sampling


def level_params(source: str) -> list:
    """``pytest.param`` per level ``kernels/cpu/<source>.cpp`` is built at, lowest first."""
    return [pytest.param(level.name, id=level.name) for level in levels() if level.builds(source)]


def runnable(level: str) -> bool:
    """Whether this CPU executes ``level``."""
    return level in {candidate.name for candidate in runnable_levels()}


def require_level(level: str) -> None:
    """Skip unless this CPU executes ``level`` (its instructions would kill the process)."""
    if not runnable(level):
        pytest.skip(f"this CPU does not execute the {level} level")


@contextlib.contextmanager
def capped_level(level: str) -> Iterator[None]:
    """Within the block, load the kernels as a CPU whose highest level is ``level`` would
    (``SPLITSERVE_CPU_LEVEL``; ``--dtype auto`` then picks float32 below avx512_bf16): the
    loaders' caches are emptied on entry and on exit."""
    require_level(level)
    previous = os.environ.get(LEVEL_ENV)
    os.environ[LEVEL_ENV] = level
    _clear_loaders()
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(LEVEL_ENV, None)
        else:
            os.environ[LEVEL_ENV] = previous
        _clear_loaders()


def _clear_loaders() -> None:
    for loader in (
        load_cpu_qgemv,
        load_cpu_gemv,
        load_cpu_fused_ops,
        load_cpu_decode_attention,
        load_cpu_prefill_attention,
        load_decode_layers_library,
        load_cpu_sampling,
    ):
        loader.cache_clear()
