"""The commands behind ``launch/netlab.py``'s links: an ``nft`` ruleset on the lab's bridge
that drops frames between hosts (cuts, losses), and ``tc`` token buckets that set a link's
bandwidth. Pure text and argv lists; the lab runs them.

Drops happen in the bridge, between the hosts, as a failed switch or cable would: neither end
learns of it from its own stack (a drop in a host's own output hook would fail its sends at
once with EPERM, which no real partition does). Frames a host sends are matched in the
bridge's ``prerouting`` hook; frames this (the root) namespace sends to a host, in its
``output`` hook.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DIRECTIONS = ("in", "out", "both")
BUCKET_S = 0.01
"""A token bucket holds this long a burst at its rate (at least ``MIN_BURST_BYTES``): the
kernel refills it per timer tick, so a smaller one caps the rate below what it is set to."""
MIN_BURST_BYTES = 256 * 1024
"""Above a veth's largest segment (64 KiB with GSO): a smaller bucket never passes one."""
QUEUE_LATENCY_MS = 50


@dataclass(frozen=True)
class Drop:
    """Frames from ``source`` to ``destination`` (addresses; None: any) are dropped, all of
    them or ``percent`` of them."""

    source: str | None
    destination: str | None
    percent: int = 100

    def rule(self) -> str:
        match = []
        if self.source is not None:
            match.append(f"ip saddr {self.source}")
        if self.destination is not None:
            match.append(f"ip daddr {self.destination}")
        if not match:
            raise ValueError("a drop names a source or a destination")
        if self.percent < 100:
            match.append(f"numgen random mod 100 < {self.percent}")
        return " ".join([*match, "drop"])


def cut_drops(host: str, peers: Sequence[str] | None, direction: str) -> list[Drop]:
    """The drops that cut ``host`` (an address) from ``peers`` (addresses; None: everyone,
    this namespace included): what it receives (``in``), what it sends (``out``) or both."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction is one of {DIRECTIONS}, not {direction!r}")
    others: Sequence[str | None] = [None] if peers is None else peers
    if not others:
        raise ValueError("no peers to cut (None means everyone)")
    drops = []
    for other in others:
        if direction in ("in", "both"):
            drops.append(Drop(other, host))
        if direction in ("out", "both"):
            drops.append(Drop(host, other))
    return drops


def loss_drops(host: str, peers: Sequence[str] | None, percent: int) -> list[Drop]:
    """Drop ``percent`` of the frames ``host`` receives from ``peers`` (None: anyone), each
    drawn independently (``numgen random``)."""
    if not 0 < percent < 100:
        raise ValueError(f"a loss is between 0 and 100 percent, not {percent}")
    return [Drop(other, host, percent) for other in ([None] if peers is None else peers)]


def bridge_ruleset(table: str, drops: Sequence[Drop]) -> str:
    """The whole bridge table holding ``drops`` (replacing the table's earlier content)."""
    rules = "".join(f"    {drop.rule()}\n" for drop in drops)
    chains = "".join(
        f"  chain {hook} {{\n    type filter hook {hook} priority 0; policy accept;\n{rules}  }}\n"
        for hook in ("prerouting", "output")
    )
    emptied = f"table bridge {table} {{}}\ndelete table bridge {table}\n"  # made, then dropped
    return f"{emptied}table bridge {table} {{\n{chains}}}\n"


def tbf_commands(device: str, gbit: float) -> list[list[str]]:
    """``tc`` commands giving ``device``'s egress a token bucket of ``gbit`` Gbit/s."""
    if gbit <= 0:
        raise ValueError(f"a link's rate must be positive, not {gbit} Gbit/s")
    rate_bytes = gbit * 1e9 / 8
    burst = max(MIN_BURST_BYTES, int(rate_bytes * BUCKET_S))
    return [
        ["tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate",
         f"{round(gbit * 1000)}mbit", "burst", str(burst), "latency", f"{QUEUE_LATENCY_MS}ms"],
    ]  # fmt: skip
