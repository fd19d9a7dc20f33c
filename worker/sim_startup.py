"""A simulated worker's start-up, waited out: it serves when the real worker would.

A real worker takes seconds to start (imports, weights, kernels, a first step: the profile's
``startup_s``, measured by ``splitserve profile``); a simulated one loads nothing and would
serve at once, so an autoscaler tried on simulated workers would never wait for a worker it
asked for. ``wait_out_startup`` holds a simulated worker back until its process is
``--sim-startup-s`` old (default: the profile's ``startup_s``, 0 where unmeasured) before it
announces itself ready. A real engine does not wait.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from splitserve.engine.sim_profile import load_profile


def process_age_s() -> float:
    """Seconds since this process started (Linux ``/proc``; elsewhere since this module was
    imported)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime", encoding="ascii") as uptime:
            since_boot_s = float(uptime.read().split()[0])
    except (OSError, IndexError, ValueError):
        return time.monotonic() - _IMPORTED_AT
    started_ticks = int(fields[19])  # field 22 of stat, counted after the command's ")"
    return since_boot_s - started_ticks / os.sysconf("SC_CLK_TCK")


def startup_of(args: argparse.Namespace) -> float:
    """The start-up a simulated worker reproduces: ``--sim-startup-s``, else its profile's."""
    if args.sim_startup_s is not None:
        return float(args.sim_startup_s)
    return load_profile(args.sim_profile).startup_s


async def wait_out_startup(args: argparse.Namespace) -> None:
    """For a simulated engine (``--engine sim``), sleep until the process is as old as the
    start-up it reproduces; return at once for a real one."""
    if args.engine != "sim":
        return
    remaining_s = startup_of(args) - process_age_s()
    if remaining_s > 0:
        await asyncio.sleep(remaining_s)


_IMPORTED_AT = time.monotonic()
