"""``splitserve top``: a live view of a cluster in the terminal, from what a coordinator knows.

    splitserve top --coordinator 127.0.0.1:50052 --metrics http://127.0.0.1:9400/metrics

Every ``--interval`` seconds it asks the coordinator's internal port for its workers
(``ListWorkers``, with the cluster credential read as the roles read it: ``SPLITSERVE_CLUSTER_
TOKEN``, ``--cluster-token-file``) and, with ``--metrics``, scrapes the coordinator's
Prometheus endpoint, and redraws one frame:

- a header: workers (routable of registered), requests in flight and queued for KV, and over
  the last interval the requests finished a second, the tokens they generated a second,
  where prompts were computed (remote on a prefill worker / local on the decode worker),
  resumes and stalls;
- a row per worker: role, routable, running / waiting / reserved requests, KV blocks in use,
  prompt tokens queued, requests finished, its learned step model (decode base + per request,
  ms), and the age of its last heartbeat.

``--once`` prints one frame (two scrapes ``--interval`` apart, for the rates) and exits. Exit
status 1 when the coordinator cannot be reached or refuses the credential (the error is
printed), 2 for flags it cannot use. Torch-free.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc
from prometheus_client.parser import text_string_to_metric_families

from splitserve.common.env_flags import built_or_exit
from splitserve.common.errors import SplitserveError
from splitserve.common.membership import MemberStatus
from splitserve.proto.cluster_auth import (
    ClusterCredential,
    add_cluster_auth_args,
    credential_from_args,
)
from splitserve.proto.membership_client import MembershipClient
from splitserve.proto.tls import TlsConfig, add_tls_args, tls_or_exit

CALL_TIMEOUT_S = 5.0
CLEAR = "\x1b[H\x1b[2J"
SCRAPED = {
    "splitserve_num_requests_in_flight": "in_flight",
    "splitserve_admission_queued_requests": "queued",
    "splitserve_request_success_total": "finished",
    "splitserve_request_generation_tokens_sum": "tokens",
    "splitserve_stream_stalls_total": "stalls",
}
"""Coordinator samples summed over their labels, by the name a frame gives them."""


@dataclass(frozen=True)
class Scrape:
    """The coordinator's figures at one moment (``SCRAPED``, placements by where, resumes)."""

    at: float
    figures: Mapping[str, float]
    placements: Mapping[str, float]
    """Prompts placed so far, by where: remote, local."""
    resumes: float


def scrape(url: str, timeout_s: float = CALL_TIMEOUT_S) -> Scrape:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        text = response.read().decode()
    figures = dict.fromkeys(SCRAPED.values(), 0.0)
    placements: dict[str, float] = {}
    resumes = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in SCRAPED:
                figures[SCRAPED[sample.name]] += sample.value
            elif sample.name == "splitserve_placement_decisions_total":
                where = sample.labels.get("where", "?")
                placements[where] = placements.get(where, 0.0) + sample.value
            elif (
                sample.name == "splitserve_request_recoveries_total"
                and sample.labels.get("kind") == "decode_resume"
            ):
                resumes += sample.value
    return Scrape(time.monotonic(), figures, placements, resumes)


def render(
    address: str,
    members: Sequence[MemberStatus],
    now: Scrape | None = None,
    before: Scrape | None = None,
) -> str:
    """One frame (see the module docstring); rates need both scrapes."""
    routable = sum(member.routable for member in members)
    lines = [f"splitserve top: {address}  {time.strftime('%H:%M:%S')}  "
             f"workers {routable} routable of {len(members)}"]  # fmt: skip
    if now is not None:
        figures = now.figures
        lines[0] += f"  in flight {figures['in_flight']:.0f}  queued {figures['queued']:.0f}"
    if now is not None and before is not None and now.at > before.at:
        lines.append(_rates(now, before))
    header = (
        f"{'WORKER':<20} {'ROLE':<8} {'ROUTABLE':<8} {'RUN':>4} {'WAIT':>4} {'RESV':>4} "
        f"{'KV USED':>8} {'PROMPT Q':>8} {'DONE':>6}  {'STEP MS (base+per req)':<22} {'HB AGE':>6}"
    )
    lines += ["", header]
    for member in sorted(members, key=lambda m: (m.info.role.value, m.info.worker_id)):
        load, cost = member.load, member.load.step_cost
        used = load.num_used_blocks / load.num_total_blocks if load.num_total_blocks else 0.0
        step = "-"
        if cost.knows_decode:
            step = f"{cost.decode_base_s * 1e3:.1f}+{cost.per_decode_seq_s * 1e3:.2f}"
        state = "yes" if member.routable else ("no" if member.ready else "stalled")
        lines.append(
            f"{member.info.worker_id:<20} {member.info.role.value:<8} {state:<8} "
            f"{load.num_running_requests:>4} {load.num_waiting_requests:>4} "
            f"{load.num_reserved_requests:>4} {used:>8.0%} {load.num_pending_prefill_tokens:>8} "
            f"{load.num_finished_requests:>6}  {step:<22} {member.ms_since_heartbeat / 1000:>5.1f}s"
        )
    return "\n".join(lines)


def _rates(now: Scrape, before: Scrape) -> str:
    seconds = now.at - before.at

    def rate(name: str) -> float:
        return max(0.0, now.figures[name] - before.figures[name]) / seconds

    placed = {
        where: now.placements.get(where, 0.0) - before.placements.get(where, 0.0)
        for where in ("remote", "local")
    }
    total = sum(placed.values())
    mix = "none placed"
    if total > 0:
        mix = f"remote {placed['remote'] / total:.0%} / local {placed['local'] / total:.0%}"
    return (
        f"finished {rate('finished'):.1f} req/s  {rate('tokens'):,.0f} tok/s  prompts: {mix}  "
        f"resumes {now.resumes - before.resumes:.0f}  stalls {rate('stalls') * seconds:.0f}"
        f"  (last {seconds:.1f} s)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve top", description=__doc__.splitlines()[0])
    parser.add_argument("--coordinator", required=True, help="the coordinator's internal host:port")
    parser.add_argument("--metrics", default=None, help="the coordinator's /metrics URL")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between frames")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    add_cluster_auth_args(parser)
    add_tls_args(parser)
    return parser


async def _frames(
    args: argparse.Namespace, credential: ClusterCredential, tls: TlsConfig | None
) -> int:
    if tls is None:
        channel = grpc.aio.insecure_channel(args.coordinator)
    else:
        channel = grpc.aio.secure_channel(args.coordinator, tls.channel_credentials())
    async with channel:
        client = MembershipClient(channel, credential)
        before = scrape(args.metrics) if args.metrics else None
        while True:
            await asyncio.sleep(args.interval)
            try:
                members = await client.list_workers(CALL_TIMEOUT_S)
            except SplitserveError as error:
                print(f"splitserve top: {args.coordinator}: {error}", file=sys.stderr)
                return 1
            now = scrape(args.metrics) if args.metrics else None
            frame = render(args.coordinator, members, now, before)
            print(frame if args.once or not sys.stdout.isatty() else CLEAR + frame, flush=True)
            if args.once:
                return 0
            before = now


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    tls = tls_or_exit(parser, args)
    credential = built_or_exit(parser, lambda: credential_from_args(args))  # else exit 2
    if args.interval <= 0:
        parser.error("--interval must be positive")
    try:
        return asyncio.run(_frames(args, credential, tls))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
