"""The failures only networks make, each under streaming load (issue 61, item 3).

For each case a fresh ``lab_cluster.LabCluster`` (three etcd members, two coordinators, a
gateway, a prefill and two decode workers, each on its own host of a network lab, KV over
TCP between hosts) serves ``--streams`` streamed completions through the gateway (the openai
SDK, ``ignore_eos``, ``--tokens`` each); the fault strikes when the first stream has half its
tokens (or, for the prefill host, while the prompts are being pushed), holds ``--hold-s``,
and is healed. Every stream is compared with the same prompt served before the fault (a
simulated worker's tokens are the same on every path): completed whole and equal, failed,
resumed (the coordinators' recoveries), lost or duplicated text. After the heal: the KV
blocks still held on every worker once the cluster is idle, and whether both coordinators
route to the same workers (no split brain). Stall: each stream's longest gap between two
chunks, p50 and p99 over the streams.

Cases: a decode host partitioned from everything; the prefill host partitioned while pushing
KV; a coordinator cut from etcd (not from workers or gateway) and the reverse; the gateway cut
from one coordinator; a lossy (5%) and a narrow (100 Mbit/s) link to one decode host; etcd
losing quorum (two of three members cut off). No added latency: the kernel has no netem.

Usage (root): ``python bench/bench_network_faults.py`` writes
``bench/results/network-faults-<date>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import openai
from lab_cluster import HOSTS, LabCluster
from timing_stats import percentile

from splitserve.common.cpu_info import cpu_name
from splitserve.launch.netlab import Lab, missing

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Case:
    name: str
    strike: Callable[[Lab, str], None]
    """Strikes the lab; the second argument is the decode host streaming the most requests
    at the time (``d1`` for a fault at the start)."""
    heal: Callable[[Lab], None]
    at_start: bool = False
    """Strike right after the streams are sent (else once the first is half done)."""
    long_prompts: bool = False


def _lose_quorum(lab: Lab, _decode: str) -> None:
    lab.cut("e2")
    lab.cut("e3")


def _heal_all(lab: Lab) -> None:
    for host in lab.hosts:
        lab.heal(host)
        lab.unshape(host)


CASES = (
    Case("decode host partitioned", lambda lab, d: lab.cut(d), _heal_all),
    Case(
        "prefill host partitioned pushing KV",
        lambda lab, _: lab.cut("p1"),
        _heal_all,
        at_start=True,
        long_prompts=True,
    ),  # fmt: skip
    Case("coordinator cut from etcd", lambda lab, _: lab.cut("c1", ["e1", "e2", "e3"]), _heal_all),
    Case(
        "coordinator cut from workers and gateway",
        lambda lab, _: lab.cut("c1", ["p1", "d1", "d2", "g"]),
        _heal_all,
    ),  # fmt: skip
    Case("gateway cut from one coordinator", lambda lab, _: lab.cut("g", ["c1"]), _heal_all),
    Case("5% loss to a decode host", lambda lab, d: lab.lose(d, 5), _heal_all, at_start=True),
    Case(
        "100 Mbit/s link to a decode host",
        lambda lab, d: lab.shape(d, 0.1),
        _heal_all,
        at_start=True,
        long_prompts=True,
    ),  # fmt: skip
    Case("etcd loses quorum", _lose_quorum, _heal_all),
)


@dataclass
class Stream:
    text: str = ""
    finish: str | None = None
    error: str | None = None
    gap_s: float = 0.0


@dataclass(frozen=True)
class CaseReport:
    case: str
    decode_host: str
    """The decode host a decode-host case struck (the busiest then)."""
    sent: int
    completed: int
    failed: int
    resumed: int
    lost: int
    duplicated: int
    blocks_held_after_heal: int
    same_routable_after_heal: bool
    stall_p50_s: float
    stall_p99_s: float
    stall_max_s: float
    wall_s: float
    errors: tuple[str, ...] = ()
    """The failed streams' errors, each once."""
    short: tuple[str, ...] = ()
    """Streams that ended without an error but short of their reference: finish reason,
    characters received of the reference's."""


def _prompts(count: int, long: bool) -> list[str]:
    words = 600 if long else 40
    return [" ".join(f"w{i}x{j}" for j in range(words)) for i in range(count)]


async def _streams(
    url: str, prompts: list[str], tokens: int, half: asyncio.Event | None
) -> list[Stream]:
    sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    model = (await sdk.models.list()).data[0].id

    async def one(prompt: str) -> Stream:
        stream = Stream()
        last = time.monotonic()
        try:
            reply = await sdk.completions.create(
                model=model, prompt=prompt, max_tokens=tokens,
                stream=True, extra_body={"min_tokens": tokens, "ignore_eos": True},
            )  # fmt: skip
            async for chunk in reply:
                now = time.monotonic()
                stream.gap_s, last = max(stream.gap_s, now - last), now
                for choice in chunk.choices:
                    stream.text += choice.text
                    stream.finish = choice.finish_reason or stream.finish
                if half is not None and len(stream.text.split()) >= tokens // 3:
                    half.set()  # about half its tokens: a simulated token is most of a word
        except Exception as error:  # noqa: BLE001 - counted as failed
            stream.error = repr(error)
        return stream

    try:
        return list(await asyncio.gather(*(one(p) for p in prompts)))
    finally:
        await sdk.close()


def _write_tails(lab: Lab, path: Path) -> None:
    """Every process's last output lines, for a case whose streams went wrong."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(f"==== {p.name}\n{p.tail(400)}\n" for p in lab.processes), encoding="utf-8"
    )


def _run_case(case: Case, args: argparse.Namespace, workdir: Path) -> CaseReport:
    began = time.monotonic()
    with Lab(HOSTS) as lab:
        cluster = LabCluster(lab, workdir / case.name.replace(" ", "-"))
        cluster.start()
        prompts = _prompts(args.streams, case.long_prompts)
        reference = asyncio.run(_streams(cluster.gateway_url, prompts, args.tokens, None))
        recoveries_before = cluster.recoveries()

        victims: list[str] = []

        async def struck() -> list[Stream]:
            half = asyncio.Event()
            run = asyncio.ensure_future(_streams(cluster.gateway_url, prompts, args.tokens, half))
            if case.at_start:
                await asyncio.sleep(0.5)
            else:
                await asyncio.wait([asyncio.ensure_future(half.wait()), run],
                                   return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            decode_host = "d1" if case.at_start else await _busiest_decode_host(cluster)
            victims.append(decode_host)
            case.strike(lab, decode_host)
            await asyncio.sleep(args.hold_s)
            case.heal(lab)
            return await run

        streams = asyncio.run(struck())
        resumed = int(cluster.recoveries() - recoveries_before)
        blocks, same = asyncio.run(_after_heal(cluster))
        if args.tails is not None and any(
            s.error is not None or s.text != r.text for s, r in zip(streams, reference, strict=True)
        ):
            _write_tails(lab, args.tails / f"{case.name.replace(' ', '-')}.log")
    pairs = list(zip(streams, reference, strict=True))
    exact = [s.error is None and s.text == r.text for s, r in pairs]
    gaps = sorted(s.gap_s for s in streams)
    return CaseReport(
        case=case.name,
        decode_host=victims[0],
        sent=len(streams),
        completed=sum(exact),
        failed=sum(s.error is not None for s in streams),
        resumed=resumed,
        lost=sum(s.error is None and len(s.text) < len(r.text) for s, r in pairs),
        duplicated=sum(len(s.text) > len(r.text) for s, r in pairs),
        blocks_held_after_heal=blocks,
        same_routable_after_heal=same,
        stall_p50_s=round(statistics.median(gaps), 3),
        stall_p99_s=round(percentile(gaps, 99), 3),
        stall_max_s=round(gaps[-1], 3),
        wall_s=round(time.monotonic() - began, 1),
        errors=tuple(sorted({s.error[:300] for s in streams if s.error})),
        short=tuple(
            f"{s.finish}: {len(s.text)} of {len(r.text)}"
            for s, r in pairs
            if s.error is None and len(s.text) < len(r.text)
        ),
    )  # fmt: skip


async def _busiest_decode_host(cluster: LabCluster) -> str:
    """The decode host running the most requests, as the first coordinator that answers
    sees it (``d1`` if none answers)."""
    for view in (await cluster.members()).values():
        if isinstance(view, str):
            continue
        decoding = {m.info.worker_id: m.load.num_running_requests for m in view}
        decoding = {w: n for w, n in decoding.items() if w.startswith("d")}
        if decoding:
            return max(decoding, key=lambda w: decoding[w])
    return "d1"


async def _after_heal(cluster: LabCluster, timeout_s: float = 60.0) -> tuple[int, bool]:
    """(KV blocks held on the workers once idle, or at the timeout; whether both
    coordinators route to the same workers then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = await cluster.members()
        views = [v for v in seen.values() if not isinstance(v, str)]
        held = max((sum(m.load.num_used_blocks for m in v) for v in views), default=-1)
        routable = [frozenset(m.info.worker_id for m in v if m.routable) for v in views]
        same = len(views) == len(seen) and len(set(routable)) == 1 and len(routable[0]) == 3
        if (held == 0 and same) or time.monotonic() > deadline:
            return held, same
        await asyncio.sleep(0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=120)
    parser.add_argument("--hold-s", type=float, default=5.0)
    parser.add_argument("--cases", default=None, help="comma-separated case numbers (1-based)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tails", type=Path, default=None, help="dump logs of bad cases here")
    args = parser.parse_args()
    reason = missing()
    if reason is not None:
        print(f"bench_network_faults: no network lab here: {reason}")
        return 2
    chosen = CASES if args.cases is None else [CASES[int(i) - 1] for i in args.cases.split(",")]
    reports = []
    with tempfile.TemporaryDirectory() as workdir:
        for case in chosen:
            report = _run_case(case, args, Path(workdir))
            print(json.dumps(asdict(report)), flush=True)
            reports.append(report)
    out = args.out or RESULTS_DIR / f"network-faults-{time.strftime('%Y-%m-%d')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "streams": args.streams,
        "tokens": args.tokens, "hold_s": args.hold_s, "engine": "sim",
        "cases": [asdict(r) for r in reports],
    }, indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
