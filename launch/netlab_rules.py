"""The commands behind ``launch/netlab.py``'s links: ``nft`` rulesets that cut or thin a
host's traffic and ``tc`` token buckets that set a link's bandwidth. Pure text; the lab runs
them inside the host's namespace (``eth0`` is the host's end of its link)."""

from __future__ import annotations

from collections.abc import Sequence

TABLE = "netlab"
DIRECTIONS = ("in", "out", "both")
BUCKET_S = 0.01
"""A token bucket holds this long a burst at its rate (at least ``MIN_BURST_BYTES``): the
kernel refills it per timer tick, so a smaller one caps the rate below what it is set to."""
MIN_BURST_BYTES = 256 * 1024
"""Above a veth's largest segment (64 KiB with GSO): a smaller bucket never passes one."""
QUEUE_LATENCY_MS = 50


def _matches(peers: Sequence[str] | None) -> tuple[str, str]:
    """(input match, output match): the peers' addresses, or everything on ``eth0``."""
    if peers is None:
        return 'iifname "eth0"', 'oifname "eth0"'
    if not peers:
        raise ValueError("no peers to cut (None means everyone)")
    listed = ", ".join(peers)
    return f"ip saddr {{ {listed} }}", f"ip daddr {{ {listed} }}"


def _table(input_rules: Sequence[str], output_rules: Sequence[str]) -> str:
    def chain(name: str, rules: Sequence[str]) -> str:
        body = "".join(f"    {rule}\n" for rule in rules)
        return (
            f"  chain {name} {{\n    type filter hook {name} priority 0; policy accept;\n"
            f"{body}  }}\n"
        )

    return (
        f"table inet {TABLE} {{\n{chain('input', input_rules)}{chain('output', output_rules)}}}\n"
    )


def cut_rules(peers: Sequence[str] | None, direction: str) -> str:
    """A ruleset dropping packets from (``in``), to (``out``) or both ways with ``peers``
    (addresses; None: every packet on ``eth0``)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction is one of {DIRECTIONS}, not {direction!r}")
    match_in, match_out = _matches(peers)
    input_rules = [f"{match_in} drop"] if direction in ("in", "both") else []
    output_rules = [f"{match_out} drop"] if direction in ("out", "both") else []
    return _table(input_rules, output_rules)


def loss_rules(peers: Sequence[str] | None, percent: int) -> str:
    """A ruleset dropping ``percent`` of the packets arriving from ``peers`` (None: all on
    ``eth0``), each drawn independently (``numgen random``)."""
    if not 0 < percent < 100:
        raise ValueError(f"a loss is between 0 and 100 percent, not {percent}")
    match_in, _ = _matches(peers)
    return _table([f"{match_in} numgen random mod 100 < {percent} drop"], [])


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
