"""The container image (deploy/Dockerfile) without Docker: its stages linted, and its build
steps run as `make image-dry` runs them (a wheel with every kernel level compiled in, installed
into a fresh environment with no compile step, whose kernels load on this CPU)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
SCRIPTS = ("deploy/image/build-wheel.sh", "deploy/image/install-runtime.sh")
COMPILERS = ("g++", "gcc", "clang", "build-essential", "cmake")


def _stages() -> list[list[str]]:
    """The Dockerfile's instructions (continuation lines joined), split at each FROM."""
    lines, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        current += line.removesuffix("\\").strip() + " "
        if not line.endswith("\\"):
            lines.append(current.strip())
            current = ""
    stages: list[list[str]] = []
    for line in lines:
        if line.upper().startswith("FROM "):
            stages.append([])
        stages[-1].append(line)
    return stages


def test_the_builder_compiles_the_kernels_and_the_runtime_has_no_compiler() -> None:
    builder, runtime = _stages()
    assert builder[0].endswith(" AS builder")
    builder_text, runtime_text = " ".join(builder), " ".join(runtime)
    assert "g++" in builder_text and "deploy/image/build-wheel.sh" in builder_text
    assert "COPY --from=builder /wheels" in runtime_text
    assert "install-runtime" in runtime_text
    assert not any(compiler in runtime_text for compiler in COMPILERS)
    assert "download.pytorch.org/whl/cpu" in runtime_text  # torch's CPU build, not CUDA's
    for script in SCRIPTS:
        path = ROOT / script
        assert path.exists() and os.access(path, os.X_OK), script
    assert "--require-all" in (ROOT / SCRIPTS[1]).read_text()


def test_make_dry_runs_the_images_steps() -> None:
    result = subprocess.run(
        ["make", "-n", "image-dry"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    for script in SCRIPTS:
        assert script in result.stdout


@pytest.mark.slow  # a wheel build and a fresh environment with torch: a few minutes
def test_the_images_steps_give_an_install_whose_kernels_load() -> None:
    result = subprocess.run(
        ["make", "image-dry"], cwd=ROOT, capture_output=True, text=True, timeout=1800
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "kernel libraries" in result.stdout and "CPU kernels on" in result.stdout
