"""Builds the C++ CPU kernels at install time, once per instruction-set level.

pyproject.toml holds the project's metadata; this file adds only the kernels: each
``kernels/cpu/<source>.cpp`` compiled for each level of ``kernels/cpu_levels.py`` that builds it,
into the shared library ``splitserve/kernels/_cpu_<source>_<level><EXT_SUFFIX>``, which
``kernels/cpu_build.py`` loads with ctypes (they are plain C-ABI libraries, not Python
modules). ``pip install .``, ``pip install -e .`` (the libraries land beside the sources) and
``pip wheel .`` (the image's builder stage) all run it; builds run in parallel, one object
folder per library.

A library that does not compile (no compiler, an old one without a level's flags) is skipped
with a warning and the install goes on: at run time that kernel takes its next lower level or
the torch path, and says so in the log.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
SOURCE_DIR = Path("kernels") / "cpu"


def _levels_module():
    spec = importlib.util.spec_from_file_location("cpu_levels", ROOT / "kernels" / "cpu_levels.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def kernel_extensions() -> list[Extension]:
    """One optional extension per (source, level that builds it)."""
    cpu_levels = _levels_module()
    headers = sorted(str(path) for path in SOURCE_DIR.glob("*.h"))
    extensions = []
    for name in cpu_levels.SOURCE_NAMES:
        source = SOURCE_DIR / f"{name}.cpp"
        for level in cpu_levels.levels():
            if not level.builds(name):
                continue
            extensions.append(
                Extension(
                    f"splitserve.kernels.{cpu_levels.library_module(name, level)}",
                    sources=[str(source)],
                    depends=headers,
                    language="c++",
                    extra_compile_args=list(level.compile_flags),
                    extra_link_args=["-fopenmp"],
                    optional=True,
                )
            )
    return extensions


class BuildKernels(build_ext):
    """``build_ext`` that compiles each library into an object folder of its own (several
    libraries share one source, compiled with other flags) and builds them in parallel."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1

    def build_extension(self, ext: Extension) -> None:
        objects_dir = os.path.join(self.build_temp, ext.name)
        objects = self.compiler.compile(
            ext.sources,
            output_dir=objects_dir,
            extra_postargs=ext.extra_compile_args,
            depends=ext.depends,
        )
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        self.compiler.link_shared_object(
            objects,
            target,
            extra_postargs=ext.extra_link_args,
            target_lang="c++",
        )


setup(ext_modules=kernel_extensions(), cmdclass={"build_ext": BuildKernels})
