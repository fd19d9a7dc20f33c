"""The CPU kernels' instruction-set levels: built at install for every level, the one a CPU runs
chosen from its flags (and capped by ``SPLITSERVE_CPU_LEVEL``), a missing library falling back
to the level below with a warning, and bf16 refused at a worker's start on a CPU whose oneDNN
cannot compute it (an AVX2-only CPU, made here by capping oneDNN as ``ONEDNN_MAX_CPU_ISA``
does)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from splitserve.kernels import cpu_build
from splitserve.kernels.cpu_build import (
    level_for,
    load_library,
    loaded_kernels,
    missing_libraries,
    runnable_levels,
    running_level,
)
from splitserve.kernels.cpu_levels import LEVEL_ENV, X86_LEVELS, is_x86_64
from splitserve.proto.cluster_auth import TOKEN_ENV

ZEN3 = frozenset(["avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "sse4_2"])
"""An AVX2-only AMD EPYC's flags (Zen 3, family 25 model 1), those the levels look at."""
CASCADE_LAKE = ZEN3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"}
SAPPHIRE_RAPIDS = CASCADE_LAKE | {"avx512_bf16", "amx_tile", "amx_bf16"}
ZEN4 = CASCADE_LAKE | {"avx512_bf16"}

x86_only = pytest.mark.skipif(not is_x86_64(), reason="the x86 levels")


@x86_only
@pytest.mark.parametrize(
    ("flags", "qgemv", "gemv"),
    [
        (ZEN3, "avx2", "avx2"),
        (CASCADE_LAKE, "avx512", "avx512"),
        (ZEN4, "avx512_bf16", "avx512_bf16"),
        (SAPPHIRE_RAPIDS, "avx512_bf16", "amx"),  # only the GEMV has tiles
        (ZEN3 - {"fma"}, None, None),  # below x86-64-v3: the torch path
    ],
    ids=["zen3", "cascade-lake", "zen4", "sapphire-rapids", "no-fma"],
)
def test_each_cpu_kind_loads_the_highest_level_it_runs(
    flags, qgemv, gemv, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(LEVEL_ENV, raising=False)
    for source, expected in (("qgemv", qgemv), ("gemv", gemv)):
        level = level_for(source, flags)
        assert (level.name if level else None) == expected


@x86_only
def test_the_level_setting_caps_the_choice_and_refuses_unknown_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(LEVEL_ENV, "avx2")
    assert running_level(SAPPHIRE_RAPIDS).name == "avx2"
    assert level_for("gemv", SAPPHIRE_RAPIDS).name == "avx2"
    monkeypatch.setenv(LEVEL_ENV, "amx")  # a cap above the CPU: the CPU's own highest
    assert running_level(CASCADE_LAKE).name == "avx512"
    monkeypatch.setenv(LEVEL_ENV, "avx3")
    with pytest.raises(ValueError, match="unknown CPU kernel level 'avx3'"):
        running_level(ZEN3)


def test_the_install_built_every_level_of_every_source() -> None:
    """``setup.py`` builds at install, for every level of this architecture, whatever the
    CPU: an image built on one machine serves every CPU kind."""
    assert not missing_libraries()
    assert cpu_build.main(["--require-all"]) == 0


@x86_only
def test_a_missing_library_falls_back_a_level_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    runnable = [level for level in runnable_levels() if level.builds("fused_ops")]
    if len(runnable) < 2:
        pytest.skip("this CPU runs one level only")
    top = runnable[-1]
    real_path = cpu_build.library_path

    def without_top(name, level):
        path = real_path(name, level)
        return path.with_name("absent-" + path.name) if level is top else path

    monkeypatch.setattr(cpu_build, "library_path", without_top)
    monkeypatch.delenv(LEVEL_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
        assert load_library("fused_ops") is not None
    [loaded] = [kernel for kernel in loaded_kernels() if kernel.source == "fused_ops"]
    assert loaded.level == runnable[-2].name and loaded.wanted == top.name
    assert f"runs its {runnable[-2].name} build, not {top.name}" in caplog.text
    monkeypatch.setattr(cpu_build, "library_path", lambda name, level: real_path(name, level))
    load_library("fused_ops")  # the record back to what the process really loads


@x86_only
def test_a_level_this_cpu_cannot_run_is_never_loaded() -> None:
    """Its instructions would kill the process (SIGILL): refused before ``dlopen``."""
    foreign = [level for level in X86_LEVELS if level not in runnable_levels()]
    if not foreign:
        pytest.skip("this CPU runs every level")
    assert load_library("qgemv", foreign[-1].name) is None


def test_a_worker_asked_for_bf16_where_onednn_cannot_compute_it_refuses_at_start() -> None:
    """oneDNN capped to AVX2 (as on a Zen 3 EPYC): the worker exits with a usage error naming
    the missing CPU feature and the dtype that works, before loading the model; no oneDNN
    message reaches the user."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    env[TOKEN_ENV] = "a-cluster-secret-of-this-test-0123456789"
    argv = [sys.executable, "-m", "splitserve.prefill.main", "--port=0", "--dtype=bfloat16"]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--dtype bfloat16 needs a CPU with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT" in (
        result.stderr
    )
    assert "use --dtype float32 or auto" in result.stderr
    assert "mkldnn" not in result.stderr and "Traceback" not in result.stderr
