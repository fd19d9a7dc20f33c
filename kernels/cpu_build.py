"""Loading the C++ CPU kernels that ``setup.py`` built at install time, one library per
(source, instruction-set level), with ``ctypes``.

``load_library(name)`` loads ``kernels/cpu/<name>.cpp``'s build for the level this CPU runs
(``cpu_levels.level_for``: the highest built for that source that the CPU executes, capped by
``SPLITSERVE_CPU_LEVEL``); where that library is missing or does not load, the next lower
level's, with a warning naming the level lost and its cost; None (warned) when no level's
library is there. ``load_library(name, level)`` loads one named level (the tests run every
level the machine executes). Nothing is compiled here and nothing is cached in the home
directory: a library is a file of the installed package, the same on every machine of its
level (the container image ships them; its runtime stage has no compiler).

OpenMP: torch's CPU wheel loads a ``libgomp.so.1`` first, the soname these libraries link, so
both share one runtime and thread pool.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sysconfig
import threading
from dataclasses import dataclass
from pathlib import Path

from splitserve.kernels.cpu_levels import (
    CpuLevel,
    cpu_model_name,
    level_for,
    level_named,
    levels,
    runnable_levels,
)

logger = logging.getLogger(__name__)

LIBRARY_DIR = Path(__file__).resolve().parent
SOURCE_DIR = LIBRARY_DIR / "cpu"
KERNELS_ENV = "SPLITSERVE_CPU_KERNELS"
"""``0`` keeps every kernel on the torch path."""
NO_LIBRARY_COST = (
    "its work takes the torch path (on a decode step of the default model about 10x slower)"
)


@dataclass(frozen=True)
class LoadedKernel:
    """What ``load_library`` gave for one source: the level loaded (None: none) and why not
    the one wanted, when it is another."""

    source: str
    level: str | None
    wanted: str | None
    note: str = ""


_loaded: dict[str, LoadedKernel] = {}
_lock = threading.Lock()


def library_path(name: str, level: CpuLevel) -> Path:
    """Where ``setup.py`` puts ``kernels/cpu/<name>.cpp``'s build for ``level``."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return LIBRARY_DIR / f"_cpu_{name}_{level.name}{suffix}"


def function_address(function: ctypes._CFuncPtr) -> int:
    """A loaded library function's address, for C code that calls it through a pointer
    (``kernels/cpu_decode_layers.py``)."""
    address = ctypes.cast(function, ctypes.c_void_p).value
    assert address is not None
    return address


def _open(name: str, level: CpuLevel) -> ctypes.CDLL:
    """The library of ``name`` at ``level``; ``OSError`` when it is missing or unloadable."""
    path = library_path(name, level)
    if not path.exists():
        raise OSError(f"{path.name} is not installed (built by `make install` / `pip install`)")
    return ctypes.CDLL(os.fspath(path))


def load_library(name: str, level: str | None = None) -> ctypes.CDLL | None:
    """``kernels/cpu/<name>.cpp``'s library: at ``level`` when named (None, logged, when this
    CPU cannot run that level or it is not installed); else at the level chosen for this CPU,
    falling back level by level (warned). None when ``SPLITSERVE_CPU_KERNELS=0`` or no level's
    library loads here; callers keep the torch path."""
    if os.environ.get(KERNELS_ENV, "1") == "0":
        logger.info("CPU kernel %s disabled by %s=0", name, KERNELS_ENV)
        _record(LoadedKernel(name, None, None, f"disabled by {KERNELS_ENV}=0"))
        return None
    if level is not None:
        return _load_named(name, level_named(level))
    wanted = level_for(name)
    if wanted is None:
        logger.warning(
            "CPU kernel %s: this CPU (%s) runs no kernel level (AVX2 and FMA at least); %s",
            name, cpu_model_name(), NO_LIBRARY_COST,
        )  # fmt: skip
        _record(LoadedKernel(name, None, None, "no level runs on this CPU"))
        return None
    order = [lvl for lvl in levels() if lvl.builds(name)]
    candidates = list(reversed(order[: order.index(wanted) + 1]))
    failures = []
    for candidate in candidates:
        try:
            library = _open_runnable(name, candidate)
        except OSError as error:
            failures.append(f"{candidate.name}: {error}")
            continue
        note = ""
        if candidate is not wanted:
            note = f"{wanted.name} unavailable ({'; '.join(failures)})"
            logger.warning(
                "CPU kernel %s runs its %s build, not %s, slower on this CPU: %s",
                name, candidate.name, wanted.name, "; ".join(failures),
            )  # fmt: skip
        _record(LoadedKernel(name, candidate.name, wanted.name, note))
        return library
    logger.warning(
        "CPU kernel %s: no library loads (%s); %s", name, "; ".join(failures), NO_LIBRARY_COST
    )
    _record(LoadedKernel(name, None, wanted.name, "; ".join(failures)))
    return None


def _open_runnable(name: str, level: CpuLevel) -> ctypes.CDLL:
    """``_open`` for a level this CPU runs (``OSError`` otherwise: its instructions would
    kill the process with SIGILL)."""
    if level not in runnable_levels():
        raise OSError(f"this CPU ({cpu_model_name()}) does not run level {level.name}")
    return _open(name, level)


def _load_named(name: str, level: CpuLevel) -> ctypes.CDLL | None:
    try:
        return _open_runnable(name, level)
    except OSError as error:
        logger.info("CPU kernel %s at level %s unavailable: %s", name, level.name, error)
        return None


def _record(loaded: LoadedKernel) -> None:
    with _lock:
        _loaded[loaded.source] = loaded


def loaded_kernels() -> tuple[LoadedKernel, ...]:
    """What ``load_library`` loaded in this process so far, one entry per source (named
    levels, as the tests load them, are not recorded)."""
    with _lock:
        return tuple(_loaded[name] for name in sorted(_loaded))


def kernel_levels_line() -> str:
    """One line for logs and banners: the CPU and each loaded kernel's level."""
    parts = []
    for kernel in loaded_kernels():
        level = kernel.level or "torch path"
        parts.append(f"{kernel.source}={level}" + (f" ({kernel.note})" if kernel.note else ""))
    return f"CPU kernels on {cpu_model_name()}: " + (", ".join(parts) or "none loaded")


if __name__ == "__main__":  # `python -m splitserve.kernels.cpu_build`: what loads here
    for source_file in sorted(SOURCE_DIR.glob("*.cpp")):
        load_library(source_file.stem)
    print(kernel_levels_line())
