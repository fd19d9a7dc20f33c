"""Compile-on-first-use of the C++ CPU kernels (``kernels/cpu/*.cpp``) into a cached shared
library, loaded with ``ctypes``.

The sources include no torch headers, so one ``g++`` call takes about a second. Flags are
``-O3 -march=native -fopenmp``: the library is built on the machine that runs it, for its CPU
(AVX-512 BF16 paths where the CPU has them, portable C++ loops otherwise). OpenMP: torch's CPU
wheel loads a ``libgomp.so.1`` first, the soname this library links, so both share one runtime.

Cache: ``$SPLITSERVE_KERNEL_CACHE`` or ``~/.cache/splitserve/kernels``, one file per digest of
(source, the shared headers, flags, compiler version, CPU flags); a changed source or another
CPU builds anew.
Concurrent builders (several workers starting at once) each compile to a private temporary file
and ``os.replace`` it into place, so a reader never sees a partial library.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent / "cpu"
NATIVE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
"""Flags of the production build."""
PORTABLE_FLAGS = ("-O3", "-march=x86-64", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
"""No AVX-512: builds the portable loops (tests use it to cover that path)."""


class CpuKernelBuildError(RuntimeError):
    """The C++ kernels could not be compiled (no compiler, or it failed; message has why)."""


def cache_dir() -> Path:
    configured = os.environ.get("SPLITSERVE_KERNEL_CACHE")
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "splitserve" / "kernels"


def _compiler() -> str:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise CpuKernelBuildError("no C++ compiler found (install g++ or set CXX)")
    return compiler


def _cpu_signature() -> str:
    """The CPU's model and flags (``-march=native`` depends on them)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    wanted = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(wanted)))


def build_library(name: str, flags: tuple[str, ...] = NATIVE_FLAGS) -> Path:
    """Path of the compiled ``kernels/cpu/<name>.cpp`` for ``flags``, compiling it if needed.

    Raises ``CpuKernelBuildError`` with the compiler's output when compiling fails.
    """
    source = SOURCE_DIR / f"{name}.cpp"
    compiler = _compiler()
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        raise CpuKernelBuildError(f"{compiler} --version failed: {error}") from error
    digest = hashlib.blake2b(digest_size=12)
    headers = [path.read_bytes() for path in sorted(SOURCE_DIR.glob("*.h"))]
    for part in (source.read_bytes(), *headers, " ".join(flags).encode(), version.encode()):
        digest.update(part)
    digest.update(_cpu_signature().encode())
    target = cache_dir() / f"{name}-{digest.hexdigest()}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=target.parent)
    os.close(handle)
    try:
        result = subprocess.run(
            [compiler, *flags, "-o", partial, str(source)], capture_output=True, text=True
        )
        if result.returncode != 0:
            raise CpuKernelBuildError(
                f"compiling {source.name} failed ({compiler} {' '.join(flags)}):\n{result.stderr}"
            )
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def function_address(function: ctypes._CFuncPtr) -> int:
    """A loaded library function's address, for C code that calls it through a pointer
    (``kernels/cpu_decode_layers.py``)."""
    address = ctypes.cast(function, ctypes.c_void_p).value
    assert address is not None
    return address


def load_library(name: str, flags: tuple[str, ...] = NATIVE_FLAGS) -> ctypes.CDLL | None:
    """The loaded ``kernels/cpu/<name>.cpp`` library, or None (logged) when
    ``SPLITSERVE_CPU_KERNELS=0`` or it cannot be built or loaded here (callers keep torch)."""
    if os.environ.get("SPLITSERVE_CPU_KERNELS", "1") == "0":
        logger.info("CPU kernel %s disabled by SPLITSERVE_CPU_KERNELS=0", name)
        return None
    try:
        return ctypes.CDLL(os.fspath(build_library(name, flags)))
    except (CpuKernelBuildError, OSError) as error:
        logger.warning("CPU kernel %s unavailable, using the torch path: %s", name, error)
        return None


if __name__ == "__main__":  # `python -m splitserve.kernels.cpu_build`: warm the cache
    for source_file in sorted(SOURCE_DIR.glob("*.cpp")):
        print(build_library(source_file.stem))
