"""Choosing and loading the C++ CPU kernels that ``setup.py`` built at install time, one
library per (source, instruction-set level of ``cpu_levels.py``), with ``ctypes``.

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

from splitserve.common.cpu_info import cpu_flags, cpu_name
from splitserve.kernels.cpu_levels import (
    GENERIC_LEVELS,
    LEVEL_ENV,
    SOURCE_NAMES,
    X86_LEVELS,
    CpuLevel,
    is_x86_64,
    level_named,
    levels,
    library_module,
)

logger = logging.getLogger(__name__)

LIBRARY_DIR = Path(__file__).resolve().parent
KERNELS_ENV = "SPLITSERVE_CPU_KERNELS"
"""``0`` keeps every kernel on the torch path."""
NO_LIBRARY_COST = (
    "its work takes the torch path (on a decode step of the default model about 10x slower)"
)


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


def _up_to(top: CpuLevel) -> tuple[CpuLevel, ...]:
    """The levels from the lowest up to ``top``, lowest first."""
    ordered = levels()
    return ordered[: ordered.index(top) + 1]


def running_level(flags: frozenset[str] | None = None) -> CpuLevel | None:
    """The highest level this CPU runs, capped by ``SPLITSERVE_CPU_LEVEL``; None when it runs
    none (a CPU without AVX2 and FMA), or the cap is below all it runs."""
    runnable = runnable_levels(flags)
    cap = level_cap()
    if cap is not None:
        runnable = tuple(level for level in runnable if level in _up_to(cap))
    return runnable[-1] if runnable else None


def _fallbacks(source: str, top: CpuLevel) -> list[CpuLevel]:
    """The levels that build ``source`` from ``top`` down, highest first: where its library
    is looked for when the one above is missing."""
    return [level for level in reversed(_up_to(top)) if level.builds(source)]


def level_for(source: str, flags: frozenset[str] | None = None) -> CpuLevel | None:
    """The level ``source``'s library is loaded at here: the highest that builds it among
    those ``running_level`` allows; None when there is none."""
    top = running_level(flags)
    built = [] if top is None else _fallbacks(source, top)
    return built[0] if built else None


def cpu_has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether the kernels run a bf16 level here (AVX-512 BF16 or AMX, within the cap): where
    ``--dtype auto`` picks bf16."""
    level = running_level(flags)
    return level is not None and level.computes_bf16


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
    return LIBRARY_DIR / f"{library_module(name, level)}{suffix}"


def function_address(function: ctypes._CFuncPtr) -> int:
    """A loaded library function's address, for C code that calls it through a pointer
    (``kernels/cpu_decode_layers.py``)."""
    address = ctypes.cast(function, ctypes.c_void_p).value
    assert address is not None
    return address


def require(condition: bool, message: str) -> None:
    """A kernel wrapper's argument check: ``ValueError(message)`` unless ``condition`` (what
    the C side trusts is checked before the call)."""
    if not condition:
        raise ValueError(message)


def bind_functions(library: ctypes.CDLL, signatures: dict[str, list[type]]) -> None:
    """Declare each ``symbol: argument types`` of ``signatures`` on ``library``, every one
    returning a C ``int`` status (0: done)."""
    for symbol, argtypes in signatures.items():
        function = getattr(library, symbol)
        function.argtypes = argtypes
        function.restype = ctypes.c_int


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
            name, cpu_name(), NO_LIBRARY_COST,
        )  # fmt: skip
        _record(LoadedKernel(name, None, None, "no level runs on this CPU"))
        return None
    failures = []
    for candidate in _fallbacks(name, wanted):
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
        raise OSError(f"this CPU ({cpu_name()}) does not run level {level.name}")
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
    return f"CPU kernels on {cpu_name()}: " + (", ".join(parts) or "none loaded")


def kernel_plan_line() -> str:
    """What a worker started now would load, without loading it (for launchers): the level
    this CPU runs and, per source, the level whose library is installed, where that is lower.
    """
    top = running_level()
    if top is None:
        return f"CPU kernels: none run on {cpu_name()} (no AVX2 + FMA): torch path"
    if os.environ.get(KERNELS_ENV, "1") == "0":
        return f"CPU kernels: off ({KERNELS_ENV}=0)"
    short = []
    for name in SOURCE_NAMES:
        wanted = level_for(name)
        if wanted is None:
            continue
        installed = [lvl for lvl in _fallbacks(name, wanted) if library_path(name, lvl).exists()]
        if not installed or installed[0] is not wanted:
            got = installed[0].name if installed else "torch path"
            short.append(f"{name} at {got} (its {wanted.name} build is missing)")
    capped = f", capped by {LEVEL_ENV}" if level_cap() is not None else ""
    line = f"CPU kernels: level {top.name} on {cpu_name()}{capped}"
    return line + ("; " + "; ".join(short) if short else "")


def missing_libraries() -> list[str]:
    """The kernel libraries of this architecture's levels that are not installed (each should
    be: ``setup.py`` builds every level whatever the CPU, so an image serves every kind)."""
    return [
        library_path(name, level).name
        for name in SOURCE_NAMES
        for level in levels()
        if level.builds(name) and not library_path(name, level).exists()
    ]


def main(argv: list[str] | None = None) -> int:
    """``python -m splitserve.kernels.cpu_build [--require-all]``: what a worker would load
    here and what loads; ``--require-all`` exits 1 when a level's library is missing or this
    CPU's level does not load (the image's build checks itself with it)."""
    import argparse

    import torch  # noqa: F401  # its libgomp.so.1 first, as in a worker

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--require-all", action="store_true")
    args = parser.parse_args(argv)
    for source_name in SOURCE_NAMES:
        load_library(source_name)
    print(kernel_plan_line())
    print(kernel_levels_line())
    if not args.require_all:
        return 0
    missing = missing_libraries()
    unloaded = [kernel.source for kernel in loaded_kernels() if kernel.note or not kernel.level]
    if missing or (running_level() is not None and unloaded):
        print(f"missing: {missing}; not loaded at this CPU's level: {unloaded}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
