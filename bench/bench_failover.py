"""What etcd membership costs ``make serve``, and the gap a stream sees when its coordinator dies.

Two parts, one after the other in one run (``--parts``), one ``splitserve up`` cluster at a time,
each started fresh on free ports in ``make serve``'s layout (1 prefill + 1 decode worker, each
pinned to a core, coordinator, OpenAI gateway; default flags otherwise). Every cluster runs the
source tree of this checkout (the working tree: ``--etcd-endpoints`` on ``up`` may not be
committed yet), or with ``--commit`` that commit in a temporary ``git worktree`` imported through
``PYTHONPATH`` (``bench_security.tree_env``); before each start a child with the cluster's
environment must import ``splitserve.launch.up`` from that tree.

**membership**: two configurations, interleaved round by round (``default``, ``etcd``, again),
each run a freshly started cluster:

- ``default``: workers register with the coordinator over gRPC (nothing else runs);
- ``etcd``: the same plus ``--etcd-endpoints=127.0.0.1:<port>``: the workers announce
  themselves in etcd and the coordinator watches it. Each run gets a fresh single-member etcd
  server (``tests/etcd.py``'s ``EtcdServer``: ``etcd_binary()``, free ports, a new data
  directory, ``--unsafe-no-fsync``), started before ``up`` and stopped after it; its CPU time
  during the load counts as the cluster's, and its CPU seconds over its whole life (start to
  stop, from ``getrusage`` of the reaped child) are noted per run.

A run is ``bench_security.measure``: the same load as the security benchmark, with the same
defaults (through the gateway's streamed ``/v1/completions`` with ``targets.OpenAITarget``,
greedy, ``ignore_eos``, random prompt token ids, new prompts every phase and round, the same for
both configurations in a round): ``--warmup-requests`` one at a time, then ``poisson``
(``--num-requests`` at ``--rate`` req/s), ``burst`` (``--burst-requests`` at once) and
``sequential`` (``--sequential-requests`` one at a time). Also measured: the time from launching
``up`` to its ``splitserve ready at`` line (``start_s``; for ``etcd`` with etcd already
running), and the cluster's CPU share during the load. Rounds and quiet runs as in
``bench_security.run``: a run in which other processes took more than ``--max-other-share`` of
the CPUs (``CpuMeter``) is noisy; rounds go on until both configurations have ``--repeats``
quiet runs or ``--max-rounds`` ran. Reports, per configuration, medians over the quiet runs
(every run if none was), and etcd/default of those medians with the range of the per-round
ratios over the rounds in which both runs were quiet.

**failover**: ``up --coordinators 2`` (every worker registered with both coordinators, the
gateway balancing over both; coordinator-1's public port is coordinator-0's + 2; the workers
get ``--failover-worker-flags``, none by default, as in ``make serve``). First an
uninterrupted reference run: ``--failover-streams`` greedy streams at once through the gateway
(``OpenAITarget``: random prompt token ids, ``--failover-input-len`` tokens,
``--failover-max-tokens`` output tokens with ``ignore_eos``). Then ``--failover-rounds`` rounds
of the same streams (same prompts): once every stream has received ``--kill-after`` tokens, one
coordinator is SIGKILLed (coordinator-0 in even rounds, coordinator-1 in odd ones; its pid from
``up``'s children by ``--port``, ``tests/cluster.py:child_pid``); ``up`` restarts it, and the
next round starts once it serves again (its health SERVING on its public port). Every streamed
chunk is stamped on arrival (``time.perf_counter``, in the load generator's event loop; a
chunk's tokens share its stamp). Per stream:

- the gap across the failover: the gap between the last token received before the SIGKILL and
  the first one after it (none for a stream that had ended before);
- every other gap of the round's streams: the baseline ITL of the same rounds (ITL as
  ``serving_stats`` counts it: a chunk of k tokens adds k - 1 zero gaps).

Which streams the killed coordinator carried the client cannot see. The coordinators count
them: ``splitserve_request_recoveries_total{kind="coordinator_continuation"}`` on their
Prometheus ``/metrics`` (the ``<name> metrics at <url>`` lines of ``up``): the survivor's
increase over the round plus the restarted coordinator's count (it starts at 0) is k, the
streams continued in that round. **Rule: the k largest gaps across the failover of a round are
labelled continued, the others not continued.** Reports: continued streams; p50/p99/max of the
gap across the failover for continued and for not-continued streams; the baseline ITL p50/p99
of the same rounds and of the reference run; failed requests (must be 0); how many streams'
text or token count differ from the reference run's (greedy streams are deterministic, so 0
where the resumed decode recomputes exactly: ``--failover-worker-flags=--dtype=float32``, as
``tests/test_coordinator_failover.py`` runs it; in bf16, ``make serve``'s dtype on a CPU that
has it, a moved stream's recomputed KV can flip a near-tie and its text go another way, with
the same token count); the time from the SIGKILL until the restarted coordinator served again
(``up``'s restart back-off doubles when a child dies within a minute of its start, so later
rounds wait longer; the gaps do not depend on it). ``CpuMeter`` reports per round the share of
the CPUs other processes took (noisy rounds are kept and marked, not redone).

``--render-readme RESULTS.json`` prints the README section of a results file.

Usage: ``.venv/bin/python bench/bench_failover.py --repeats 3 --failover-rounds 6``
(writes ``bench/results/failover-<date>.json`` unless ``--out`` says otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import datetime
import json
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from bench_security import (
    REPO_ROOT,
    RESULTS_DIR,
    ServerConfig,
    check_tree,
    git_worktree,
    log,
    resolve_commit,
    served_model,
    tree_env,
    write_json,
)
from bench_security import run as run_rounds
from cluster_process import ClusterError, CpuMeter, LocalCluster
from failover_cluster import EtcdConfig, failover_cluster, tests_helper
from failover_report import (
    failover_summary,
    gap_stats,
    membership_summary,
    print_summary,
    readme_section,
    round_figures,
    summarized,
)
from loadgen import run_requests
from serving_stats import RequestRecord
from targets import OpenAITarget, StreamEvent
from timing_stats import Json, wait_for_quiet
from workload import LengthDist, RequestSpec, WorkloadConfig, build_workload

from splitserve.client import AsyncClient

FAILOVER_SEED = 7000
"""The failover streams' prompts: workload seed ``--seed + FAILOVER_SEED``."""
CONTINUATIONS = re.compile(
    r'^splitserve_request_recoveries_total\{[^}]*kind="coordinator_continuation"[^}]*\}\s+(\S+)',
    re.MULTILINE,
)
STREAM_START_TIMEOUT_S = 120.0
STREAM_FINISH_TIMEOUT_S = 300.0


# ---------------------------------------------------------------- membership: etcd vs default


def run_membership(args: argparse.Namespace, tree: Path, env: dict[str, str], out: Path) -> Json:
    """Interleaved rounds of ``default`` and ``etcd`` (``bench_security.run``); the part's
    document with each etcd run's notes."""
    label = describe_tree(args, tree)
    default = ServerConfig(
        name="default", description=f"{label}: gRPC registration", env=env, tree=tree
    )
    etcd = EtcdConfig(
        name="etcd",
        description=f"{label}: --etcd-endpoints at a fresh etcd server per run",
        env=env,
        tree=tree,
        workdir=args.log_dir,
    )
    document = run_rounds(args, [default, etcd], out)
    for run, note in zip(document["runs"]["etcd"], etcd.notes, strict=False):
        run["etcd"] = note
    return membership_summary(document)


# ---------------------------------------------------------------- failover: a coordinator dies


class Watched:
    """A target that passes every event on and keeps each stream's text and token count so
    far (to know when to kill, and to compare with the reference)."""

    def __init__(self, target: OpenAITarget) -> None:
        self.target = target
        self.name = target.name
        self.reset(0)

    def reset(self, count: int) -> None:
        self.tokens, self.texts, self.ended = [0] * count, [""] * count, [False] * count

    async def open(self) -> None:
        await self.target.open()

    async def close(self) -> None:
        await self.target.close()

    async def stream(self, request: RequestSpec) -> AsyncIterator[StreamEvent]:
        async for event in self.target.stream(request):
            self.tokens[request.index] += event.num_tokens
            self.texts[request.index] += event.text
            self.ended[request.index] = event.final
            yield event


@dataclass(frozen=True)
class Coordinator:
    name: str
    """As ``up`` names it (its output's prefix): ``coordinator-<i>``."""
    address: str
    """Public host:port."""

    @property
    def port(self) -> str:
        return self.address.rsplit(":", 1)[1]

    def pid(self, cluster: LocalCluster) -> int:
        assert cluster.child is not None
        child_pid = tests_helper("cluster").child_pid
        return child_pid(cluster.child.pid, "splitserve.coordinator.main", f"--port={self.port}")

    def continuations(self, cluster: LocalCluster) -> int:
        """Its ``coordinator_continuation`` recoveries (the newest metrics URL it printed)."""
        url = cluster.log_lines(f"[{self.name}] coordinator metrics at ")[-1].rsplit(" ", 1)[1]
        text = httpx.get(url, timeout=10).text
        return round(sum(float(value) for value in CONTINUATIONS.findall(text)))

    def restarts(self, cluster: LocalCluster) -> int:
        return len(cluster.log_lines(f"splitserve up: {self.name} is back"))

    def wait_serving_again(self, cluster: LocalCluster, restarts: int, timeout_s: float) -> None:
        """Until ``up`` restarted it (more than ``restarts`` restarts) and it is SERVING."""
        deadline = time.monotonic() + timeout_s
        while self.restarts(cluster) <= restarts:
            if time.monotonic() > deadline or cluster.child.returncode is not None:
                raise ClusterError(f"{self.name} was not restarted:\n{cluster.tail()}")
            time.sleep(0.1)

        async def serving() -> None:
            async with AsyncClient(self.address) as client:
                await client.wait_ready(max(deadline - time.monotonic(), 1.0))

        asyncio.run(serving())


def failover_requests(args: argparse.Namespace) -> list[RequestSpec]:
    return build_workload(
        WorkloadConfig(
            num_requests=args.failover_streams,
            rate=math.inf,
            input_len=LengthDist.parse("fixed", args.failover_input_len),
            output_len=LengthDist.parse("fixed", args.failover_max_tokens),
            seed=args.seed + FAILOVER_SEED,
        )
    )


async def streams(
    target: Watched,
    requests: Sequence[RequestSpec],
    kill: tuple[int, CpuMeter, int] | None = None,
) -> tuple[list[RequestRecord], float | None, list[int]]:
    """Every request streamed at once; with ``kill`` = (pid, meter, tokens), the pid is
    SIGKILLed once every stream has that many tokens (or ended). The records, the kill instant
    (``perf_counter``) and each stream's tokens at that instant."""
    target.reset(len(requests))
    await target.open()
    try:
        task = asyncio.create_task(run_requests(target, requests))
        kill_at, tokens_at_kill = None, []
        if kill is not None:
            pid, meter, after = kill
            deadline = time.monotonic() + STREAM_START_TIMEOUT_S
            while not all(
                n >= after or e for n, e in zip(target.tokens, target.ended, strict=True)
            ):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"streams did not reach {after} tokens: {target.tokens}")
                await asyncio.sleep(0.005)
            meter.last_reading(pid)
            tokens_at_kill = list(target.tokens)
            kill_at = time.perf_counter()
            os.kill(pid, signal.SIGKILL)
        records = await asyncio.wait_for(task, STREAM_FINISH_TIMEOUT_S)
    finally:
        await target.close()
    return records, kill_at, tokens_at_kill


def split_gaps(record: RequestRecord, kill_at: float) -> tuple[float | None, list[float]]:
    """(the gap spanning ``kill_at`` or None, every other gap), in ms."""
    gaps = record.itls_ms
    after = bisect.bisect_right(record.token_times, kill_at)  # first token after the kill
    if 0 < after < len(record.token_times):
        return gaps[after - 1], gaps[: after - 1] + gaps[after:]
    return None, gaps


def outputs(records: Sequence[RequestRecord], target: Watched) -> list[tuple[str, int]]:
    return [(text, r.num_output_tokens) for r, text in zip(records, target.texts, strict=True)]


def failover_round(
    args: argparse.Namespace,
    cluster: LocalCluster,
    coordinators: Sequence[Coordinator],
    target: Watched,
    reference: Sequence[tuple[str, int]],
    index: int,
) -> Json:
    """One round: the streams, one coordinator SIGKILLed mid-stream, until it serves again."""
    busy_before = wait_for_quiet(args.quiet_wait_s)
    victim, survivor = coordinators[index % 2], coordinators[1 - index % 2]
    before = survivor.continuations(cluster)
    restarts = victim.restarts(cluster)
    pid = victim.pid(cluster)
    meter = CpuMeter(cluster)
    meter.start()
    requests = failover_requests(args)
    records, kill_at, tokens_at_kill = asyncio.run(
        streams(target, requests, (pid, meter, args.kill_after))
    )
    cpu = meter.stop()
    assert kill_at is not None
    victim.wait_serving_again(cluster, restarts, args.restart_timeout_s)
    restart_s = time.perf_counter() - kill_at
    continued = survivor.continuations(cluster) - before + victim.continuations(cluster)
    spans, other_gaps = [], []
    for record in records:
        span, others = split_gaps(record, kill_at)
        spans.append(span)
        other_gaps += others
    ranked = sorted((i for i, s in enumerate(spans) if s is not None), key=lambda i: -spans[i])
    labelled = set(ranked[:continued])
    got = outputs(records, target)
    stream_rows = [
        {
            "gap_ms": None if span is None else round(span, 2),
            "continued": i in labelled,
            "tokens_at_kill": tokens_at_kill[i],
            "tokens": record.num_output_tokens,
            "matches_reference": got[i] == tuple(reference[i]),
            "error": record.error,
        }
        for i, (span, record) in enumerate(zip(spans, records, strict=True))
    ]
    row = {
        "round": index,
        "victim": victim.name,
        "victim_pid": pid,
        "machine_busy_before": busy_before,
        "cpu": cpu,
        "quiet": cpu["other_share"] <= args.max_other_share,
        "continued": continued,
        "restart_s": round(restart_s, 2),
        "failed": sum(not r.completed for r in records),
        "mismatches": sum(not s["matches_reference"] for s in stream_rows),
        "mismatched_texts": [
            got[i] for i, s in enumerate(stream_rows) if not s["matches_reference"]
        ],
        "streams": stream_rows,
        "other_gaps_ms": [round(g, 2) for g in other_gaps],
    }
    log(f"  failover #{index}: {round_figures(row)}")
    return row


def run_failover(args: argparse.Namespace, tree: Path, env: dict[str, str], save: Any) -> Json:
    """The reference run, then ``--failover-rounds`` rounds with a kill each, in one cluster of
    two coordinators; ``save(part)`` after every round."""
    worker_flags = shlex.split(args.failover_worker_flags)
    up_flags = ("--coordinators=2", *(["--", *worker_flags] if worker_flags else []))
    config = ServerConfig(
        name="failover",
        description=f"{describe_tree(args, tree)}: up {shlex.join(up_flags)}",
        up_flags=up_flags,
        env=env,
        tree=tree,
    )
    imported = check_tree(config)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    cluster = failover_cluster(config, args.log_dir / "failover.log")
    started = time.perf_counter()
    part: Json = {"description": config.description, "imported_up": imported, "rounds": []}
    try:
        cluster.start()
        part["start_s"] = round(time.perf_counter() - started, 2)
        assert cluster.child is not None
        addresses = cluster.child.announcements()["splitserve ready"].split(",")
        coordinators = [Coordinator(f"coordinator-{i}", a) for i, a in enumerate(addresses)]
        part["coordinators"] = [c.address for c in coordinators]
        target = Watched(OpenAITarget(cluster.http_url, served_model(config, cluster.http_url)))
        records, _, _ = asyncio.run(streams(target, failover_requests(args)))
        reference = outputs(records, target)
        part["reference"] = {
            "failed": sum(not r.completed for r in records),
            "itl_ms": gap_stats([g for r in records for g in r.itls_ms]),
            "outputs": reference,
        }
        log(
            f"failover reference: {len(records)} streams, tokens "
            f"{sorted({n for _, n in reference})}, failed {part['reference']['failed']}, ITL "
            f"p50/p99 {part['reference']['itl_ms']['p50']:.1f}/"
            f"{part['reference']['itl_ms']['p99']:.1f} ms"
        )
        for index in range(args.failover_rounds):
            part["rounds"].append(
                failover_round(args, cluster, coordinators, target, reference, index)
            )
            save(failover_summary(part))
    finally:
        cluster.stop()
    return failover_summary(part)


# ---------------------------------------------------------------- the tree measured


def describe_tree(args: argparse.Namespace, tree: Path) -> str:
    if args.commit:
        return f"commit {resolve_commit(args.commit)}"
    head = resolve_commit("HEAD")
    dirty = subprocess.run(
        ["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return f"working tree at {head}" + (" with uncommitted changes" if dirty else "")


# ---------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="membership,failover")
    parser.add_argument(
        "--commit", default=None, help="run this commit (a temporary worktree), not this tree"
    )
    membership = parser.add_argument_group("membership (as bench_security.py)")
    membership.add_argument("--repeats", type=int, default=3)
    membership.add_argument("--max-rounds", type=int, default=0, help="0: twice --repeats")
    membership.add_argument("--rate", type=float, default=3.5, help="poisson phase, req/s")
    membership.add_argument("--num-requests", type=int, default=96, help="poisson phase")
    membership.add_argument("--burst-requests", type=int, default=48)
    membership.add_argument("--sequential-requests", type=int, default=8)
    membership.add_argument("--warmup-requests", type=int, default=2)
    membership.add_argument("--input-len", type=int, default=256)
    membership.add_argument("--output-len", type=int, default=64)
    failover = parser.add_argument_group("failover")
    failover.add_argument("--failover-rounds", type=int, default=6)
    failover.add_argument("--failover-streams", type=int, default=16)
    failover.add_argument("--failover-input-len", type=int, default=64)
    failover.add_argument("--failover-max-tokens", type=int, default=96)
    failover.add_argument(
        "--kill-after", type=int, default=16, help="tokens every stream has before the kill"
    )
    failover.add_argument("--restart-timeout-s", type=float, default=120.0)
    failover.add_argument(
        "--failover-worker-flags",
        default="",
        help="flags for every worker of the failover cluster (after up's --), e.g. "
        "--dtype=float32; none by default (make serve's)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quiet-wait-s", type=float, default=60.0, help="wait for idle CPUs before each start"
    )
    parser.add_argument(
        "--max-other-share",
        type=float,
        default=0.10,
        help="a run in which other processes took more of the CPUs is noisy",
    )
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/bench-failover"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--render-readme",
        type=Path,
        default=None,
        metavar="RESULTS",
        help="only print the bench log section (bench/log/) of a results file",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.render_readme is not None:
        document = summarized(json.loads(args.render_readme.read_text()))
        with contextlib.suppress(ValueError):
            args.render_readme = args.render_readme.resolve().relative_to(REPO_ROOT)
        print(readme_section(document, str(args.render_readme)), end="")
        return 0
    parts = args.parts.split(",")
    if set(parts) - {"membership", "failover"}:
        raise SystemExit(f"unknown parts {parts}")
    out = args.out or RESULTS_DIR / f"failover-{datetime.date.today().isoformat()}.json"
    started = time.monotonic()
    document: Json = {
        "date": datetime.date.today().isoformat(),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor()},
        "command": shlex.join([".venv/bin/python", "bench/bench_failover.py", *argv]),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "wall_s": 0.0,
    }

    def save(name: str, part: Json) -> None:
        document[name] = part
        document["wall_s"] = round(time.monotonic() - started, 1)
        write_json(out, document)

    with contextlib.ExitStack() as stack:
        tree, env = REPO_ROOT, {}
        if args.commit:
            directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-fo-")))
            tree = stack.enter_context(git_worktree(resolve_commit(args.commit), directory / "t"))
            env = tree_env(tree, directory)
        args.log_dir.mkdir(parents=True, exist_ok=True)
        if "membership" in parts:
            membership = run_membership(args, tree, env, out)
            for key in ("date", "machine", "settings"):
                membership.pop(key, None)
            save("membership", membership)
        if "failover" in parts:
            save("failover", run_failover(args, tree, env, lambda part: save("failover", part)))
    print_summary(document)
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
