"""How much more memory this process may take, and how many open streams fit in a share of it.

Available memory is the smaller of the machine's ``MemAvailable`` (``/proc/meminfo``) and
what the process's cgroup still allows (v2: ``memory.max`` less ``memory.current``; v1:
``memory.limit_in_bytes`` less ``memory.usage_in_bytes``; "max" or an absurd v1 limit means
none), so a container sized below its node gets the cap of its own limit, not the node's.
Read once, at start-up: a cap that moved with other processes' use would refuse differently
from one minute to the next.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CGROUP_V2 = ("sys/fs/cgroup/memory.max", "sys/fs/cgroup/memory.current")
CGROUP_V1 = (
    "sys/fs/cgroup/memory/memory.limit_in_bytes",
    "sys/fs/cgroup/memory/memory.usage_in_bytes",
)
NO_LIMIT_ABOVE = 1 << 60
"""cgroup v1 writes "no limit" as a number near 2**63."""


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _meminfo_available(root: Path) -> int | None:
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_headroom(root: Path) -> int | None:
    for limit_path, usage_path in (CGROUP_V2, CGROUP_V1):
        limit = _read_int(root / limit_path)
        usage = _read_int(root / usage_path)
        if limit is not None and usage is not None and limit < NO_LIMIT_ABOVE:
            return max(limit - usage, 0)
    return None


def available_bytes(root: Path = Path("/")) -> int | None:
    """Bytes this process may still take (module docstring); None where neither the machine
    nor the cgroup says."""
    known = [b for b in (_meminfo_available(root), _cgroup_headroom(root)) if b is not None]
    return min(known) if known else None


@dataclass(frozen=True)
class StreamCap:
    """How many streams a process holds at once, and where the figure came from."""

    streams: int
    why: str
    """E.g. "0.25 of 21.6 GiB available / 64 KiB a stream"."""

    def describe(self) -> str:
        return f"{self.streams} ({self.why})"


def stream_cap(
    bytes_per_stream: int,
    share: float,
    fallback: int,
    minimum: int = 64,
    available: int | None = None,
    root: Path = Path("/"),
) -> StreamCap:
    """Streams that fit in ``share`` of the available memory at ``bytes_per_stream`` each (at
    least ``minimum``); ``fallback`` where the memory is unknown. ``available`` overrides
    what is read under ``root``."""
    if available is None:
        available = available_bytes(root)
    if available is None:
        return StreamCap(fallback, "available memory unknown: the fallback")
    streams = max(minimum, int(available * share) // bytes_per_stream)
    why = (
        f"{share:g} of {available / 2**30:.1f} GiB available / "
        f"{bytes_per_stream // 1024} KiB a stream"
    )
    return StreamCap(streams, why)
