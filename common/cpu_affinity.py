"""Which cores a process runs on: the ``--cpu-affinity`` list every launch script takes.

``parse_cpu_list`` reads a list ("0,2-3"); ``pin_to_cores`` pins the calling process to one,
refusing cores it may not use. Pin before any thread starts: Linux gives a new thread its
creator's mask, so every later thread (gRPC's, torch's, the tokenizer's) keeps to the cores.
"""

from __future__ import annotations

import argparse
import os


def parse_cpu_list(text: str) -> set[int]:
    """ "0,2-3" -> {0, 2, 3}; raises ValueError for malformed lists."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    if not cpus:
        raise ValueError(f"empty CPU list {text!r}")
    return cpus


def check_cores(cpus: set[int]) -> None:
    """ValueError unless every core of ``cpus`` is among this process's cores."""
    available = os.sched_getaffinity(0)
    if not cpus <= available:
        missing = ",".join(str(cpu) for cpu in sorted(cpus - available))
        raise ValueError(f"cores {missing} are not among this process's cores")


def pin_to_cores(text: str) -> set[int]:
    """Pin this process to the cores of ``text`` (a CPU list); returns them. ValueError for a
    malformed list or cores this process may not use (nothing changed then)."""
    cpus = parse_cpu_list(text)
    check_cores(cpus)
    os.sched_setaffinity(0, cpus)
    return cpus


def pin_or_exit(parser: argparse.ArgumentParser, text: str | None) -> None:
    """``pin_to_cores(text)`` where a list is given; a bad one is the parser's usage error
    (exit 2), before the process starts anything."""
    if not text:
        return
    try:
        pin_to_cores(text)
    except ValueError as error:
        parser.error(f"--cpu-affinity: {error}")
