"""What the security features cost ``make serve``: throughput and TTFT with them on and off.

Three configurations of ``splitserve up`` (1 prefill + 1 decode worker, each pinned to a core,
coordinator and OpenAI gateway), measured in one run, interleaved (``secured``, ``plain``,
``no-credential``, then again, ``--repeats`` times), each run a freshly started cluster, so
machine noise and warm caches hit every configuration alike:

- ``secured``: ``--tls-cert/--tls-key/--tls-ca`` (every gRPC port TLS, the internal plane
  mutual TLS, the gateway HTTPS) and ``--api-keys-file`` (the gateway and the coordinator's
  public port want ``authorization: Bearer <key>``); plus the cluster credential. The client
  verifies the gateway's certificate against the test CA (``tests/certs.py``) and sends the key.
- ``plain``: no TLS, no API keys; the cluster credential (mandatory since it came) still on
  every internal call.
- ``no-credential``: the tree from before the security work (``--baseline-commit``, default
  ``59c427b``). It differs from ``plain`` by everything committed in between: the credential,
  the KV transfer's keyed tags and size checks, and also a decode hot-path change (``git log``).

Every configuration runs committed code: ``secured`` and ``plain`` that of ``--commit``
(default ``HEAD``), ``no-credential`` that of ``--baseline-commit``, each checked out as a
temporary ``git worktree`` (removed at the end; ``--tree``/``--baseline-tree`` name existing
checkouts instead), so edits in the working tree during a run change nothing. Each tree is
imported as ``splitserve`` by the same interpreter and virtual environment through
``PYTHONPATH`` (a directory holding a ``splitserve`` symlink to the tree, which comes before
the editable install); before each start the bench checks in a child with the cluster's
environment which ``splitserve.launch.up`` is imported, and after it that the coordinator
announced an internal port exactly when the tree has one. The C++ CPU kernels' sources are
the same in both commits, so both use the same compiled library.

Each cluster gets, through the gateway's streamed ``/v1/completions`` (``targets.OpenAITarget``,
greedy, ``ignore_eos``, random prompt token ids, a new seed per phase and round, so no prefix
cache hits; every configuration gets the same prompts in a round), after ``--warmup-requests``
requests one at a time:

- ``poisson``: ``--num-requests`` at ``--rate`` req/s (Poisson arrivals), ``--input-len`` /
  ``--output-len`` tokens: TTFT p50/p99, ITL and TPOT p50, output and request throughput under
  load (below capacity the throughputs follow the arrival rate; the default 3.5 req/s of
  256 + 64 tokens is about 75% of what the 1 + 1 pair completes in a burst on this machine);
- ``burst``: ``--burst-requests`` sent at once: output and request throughput at capacity;
- ``sequential``: ``--sequential-requests`` one at a time: unloaded TTFT and TPOT.

The machine is shared: a run in which other processes took more than ``--max-other-share``
of the CPUs (``CpuMeter``) counts as noisy; rounds go on until every configuration has
``--repeats`` quiet runs, or ``--max-rounds`` ran. Noisy runs stay in the JSON, and their
failed requests are reported with the others.

Reports, per configuration, medians over its quiet runs (every run if none was quiet), and
the ratios secured/plain and plain/no-credential of those medians, with the range of the
per-round ratios over the rounds in which both runs were quiet (they ran back to back).
Before each cluster starts the bench waits up to ``--quiet-wait-s`` for idle CPUs.

Usage: ``.venv/bin/python bench/bench_security.py --repeats 3``
(writes ``bench/results/security-<date>.json`` unless ``--out`` says otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import hashlib
import json
import math
import os
import platform
import secrets
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from cluster_process import CpuMeter, LocalCluster
from loadgen import run_requests
from security_report import PHASES, print_summary, row_figures, summarized
from serving_stats import RequestRecord, ServingSummary, Slo, summarize
from targets import OpenAITarget
from timing_stats import Json, wait_for_quiet
from workload import LengthDist, WorkloadConfig, build_workload

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "bench" / "results"
UP_MODULE = "splitserve.launch.up"
INTERNAL_READY_NEEDLE = "coordinator internal ready at"
PHASE_SEED_STRIDE = 100
"""Seeds: ``PHASE_SEED_STRIDE * round + phase index`` (+ 50 for the warm-up)."""


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class ServerConfig:
    """How to start one configuration of ``splitserve up`` and how a client reaches it."""

    name: str
    description: str
    up_flags: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of ``up`` (inherited by its children)."""
    tree: Path = REPO_ROOT
    """The source tree that must be imported as ``splitserve``."""
    internal_port: bool = True
    api_key: str | None = None
    ca: Path | None = None
    """The CA the client trusts; set means the gateway serves HTTPS."""

    def cluster(self, log_path: Path) -> LocalCluster:
        return LocalCluster(
            Path(sys.executable).parent / "splitserve",
            list(self.up_flags),
            log_path,
            env=self.env,
            up_command=[sys.executable, "-m", UP_MODULE],
            internal_port=self.internal_port,
            https=self.ca is not None,
        )

    def verify(self) -> ssl.SSLContext | bool:
        return True if self.ca is None else ssl.create_default_context(cafile=str(self.ca))

    def headers(self) -> dict[str, str]:
        return {} if self.api_key is None else {"authorization": f"Bearer {self.api_key}"}


def tree_env(tree: Path, directory: Path) -> dict[str, str]:
    """Environment that makes ``tree`` the ``splitserve`` every process imports: a
    ``PYTHONPATH`` directory holding a ``splitserve`` symlink to it (it comes before the
    editable install's finder)."""
    path_dir = directory / f"path-{hashlib.blake2b(str(tree).encode(), digest_size=6).hexdigest()}"
    if not path_dir.exists():
        path_dir.mkdir()
        (path_dir / "splitserve").symlink_to(tree, target_is_directory=True)
    paths = [str(path_dir), os.environ.get("PYTHONPATH")]
    return {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def tree_cluster(
    up_flags: Sequence[str],
    log_path: Path,
    tree: Path | None = None,
    env: dict[str, str] | None = None,
    **options: Any,
) -> LocalCluster:
    """``splitserve up`` with ``up_flags``, from this checkout or, given ``tree``, from that
    checkout (``tree_env``: its ``splitserve`` ahead of the editable install, run as ``python
    -m splitserve.launch.up``); ``env``: more environment for ``up`` and its children;
    ``options``: ``LocalCluster``'s other arguments."""
    env = dict(env or {})
    up_command = None
    if tree is not None:
        env |= tree_env(tree.resolve(), log_path.parent)
        up_command = [sys.executable, "-m", UP_MODULE]
    splitserve = Path(sys.executable).with_name("splitserve")
    return LocalCluster(
        splitserve, list(up_flags), log_path, env=env, up_command=up_command, **options
    )


def secured_config(tree: Path, commit: str, directory: Path) -> ServerConfig:
    """TLS with a fresh test CA (mutual on the internal plane) and one API key from a file."""
    sys.path.insert(0, str(REPO_ROOT))  # tests/ is a package of the repository, not installed
    from tests.certs import make_certificates

    certificates = make_certificates(directory / "certs", name="bench-security")
    api_key = f"bench-{secrets.token_hex(16)}"
    keys_file = directory / "api-keys"
    keys_file.write_text(f"{api_key} bench\n")
    keys_file.chmod(0o600)
    return ServerConfig(
        name="secured",
        description=f"{commit}: TLS everywhere (internal mTLS, gateway HTTPS) + API key + "
        "cluster credential",
        up_flags=(*certificates.flags(), f"--api-keys-file={keys_file}"),
        env=tree_env(tree, directory),
        tree=tree,
        api_key=api_key,
        ca=certificates.ca,
    )


def plain_config(tree: Path, commit: str, directory: Path) -> ServerConfig:
    return ServerConfig(
        name="plain",
        description=f"{commit}: no TLS, no API keys; cluster credential on",
        env=tree_env(tree, directory),
        tree=tree,
    )


def baseline_config(tree: Path, commit: str, directory: Path) -> ServerConfig:
    return ServerConfig(
        name="no-credential",
        description=f"{commit} (before the security work): no credential, no TLS, no keys",
        env=tree_env(tree, directory),
        tree=tree,
        internal_port=False,
    )


def resolve_commit(commit: str) -> str:
    return subprocess.run(
        ["git", "-C", str(REPO_ROOT), "rev-parse", "--short=12", f"{commit}^{{commit}}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def imported_up(config: ServerConfig) -> Path:
    """Which ``splitserve.launch.up`` a child with the cluster's environment imports."""
    code = f"import {UP_MODULE} as m; print(m.__file__)"
    output = subprocess.run(
        [sys.executable, "-c", code],
        env=os.environ | config.env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return Path(output.strip())


def check_tree(config: ServerConfig) -> str:
    """The imported ``up`` module's path; raises unless it lies in ``config.tree``."""
    path = imported_up(config).resolve()
    if not path.is_relative_to(config.tree.resolve()):
        raise RuntimeError(f"{config.name}: {UP_MODULE} comes from {path}, not {config.tree}")
    return str(path)


def check_internal_port(config: ServerConfig, cluster: LocalCluster) -> None:
    """A second check of the tree that runs: only coordinators since the security work
    announce an internal port (``coordinator internal ready at``)."""
    announced = bool(cluster.log_lines(INTERNAL_READY_NEEDLE))
    if announced != config.internal_port:
        raise RuntimeError(
            f"{config.name}: internal port {'announced' if announced else 'missing'}; "
            f"not the expected tree ({config.tree})"
        )


@contextlib.contextmanager
def git_worktree(commit: str, directory: Path) -> Iterator[Path]:
    """``commit`` checked out (detached) at ``directory``; the worktree removed afterwards."""
    subprocess.run(
        ["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", str(directory), commit],
        check=True,
        capture_output=True,
    )
    try:
        yield directory
    finally:
        subprocess.run(
            ["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force", str(directory)],
            check=False,
            capture_output=True,
        )


def phase_workload(phase: str, args: argparse.Namespace, round_index: int) -> WorkloadConfig:
    """The requests of one phase of one round (the same for every configuration)."""
    seed = args.seed + PHASE_SEED_STRIDE * round_index + PHASES.index(phase)
    number, rate = {
        "poisson": (args.num_requests, args.rate),
        "burst": (args.burst_requests, math.inf),
        "sequential": (args.sequential_requests, math.inf),
    }[phase]
    return WorkloadConfig(
        num_requests=number,
        rate=rate,
        input_len=LengthDist.parse("fixed", args.input_len),
        output_len=LengthDist.parse("fixed", args.output_len),
        poisson=True,
        seed=seed,
    )


def served_model(config: ServerConfig, base_url: str) -> str:
    response = httpx.get(
        f"{base_url}/v1/models", headers=config.headers(), verify=config.verify(), timeout=30
    )
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def drive(
    target: OpenAITarget, args: argparse.Namespace, round_index: int
) -> dict[str, ServingSummary]:
    """Warm-up, then each phase against the opened target; the phases' summaries."""
    await target.open()
    try:
        warmup = phase_workload("sequential", args, round_index)
        warmup = WorkloadConfig(
            num_requests=args.warmup_requests,
            rate=math.inf,
            input_len=warmup.input_len,
            output_len=warmup.output_len,
            seed=warmup.seed + PHASE_SEED_STRIDE // 2,
        )
        records: list[RequestRecord] = []
        for request in build_workload(warmup):
            records += await run_requests(target, [request])
        failed = [r.error for r in records if not r.completed]
        if failed:
            log(f"warm-up failures: {failed}")
        summaries = {}
        for phase in PHASES:
            workload = phase_workload(phase, args, round_index)
            concurrency = 1 if phase == "sequential" else None
            records = await run_requests(target, build_workload(workload), concurrency)
            summaries[phase] = summarize(records, Slo())
        return summaries
    finally:
        await target.close()


def measure(
    config: ServerConfig, args: argparse.Namespace, round_index: int, log_dir: Path
) -> Json:
    """One run (of one round) of one configuration: start the cluster, drive every phase,
    stop it."""
    busy_before = wait_for_quiet(args.quiet_wait_s)
    imported = check_tree(config)
    cluster = config.cluster(log_dir / f"{config.name}-{round_index}.log")
    started = time.perf_counter()
    try:  # not ``with``: an interrupt while it starts must stop it too
        cluster.start()
        start_s = time.perf_counter() - started
        check_internal_port(config, cluster)
        model = served_model(config, cluster.http_url)
        target = OpenAITarget(
            cluster.http_url, model, api_key=config.api_key, verify=config.verify()
        )
        meter = CpuMeter(cluster)
        meter.start()
        summaries = asyncio.run(drive(target, args, round_index))
        cpu = meter.stop()
    finally:
        cluster.stop()
    phases = {name: summary.to_json() for name, summary in summaries.items()}
    for name, summary in phases.items():
        log(f"  {config.name} #{round_index} {name}: {row_figures(summary)}")
    return {
        "round": round_index,
        "url": cluster.http_url,
        "imported_up": imported,
        "machine_busy_before": busy_before,
        "start_s": round(start_s, 2),
        "cpu": cpu,
        "phases": phases,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", default="secured,plain,no-credential")
    parser.add_argument(
        "--commit", default="HEAD", help="tree of secured and plain (a temporary worktree)"
    )
    parser.add_argument(
        "--tree",
        type=Path,
        default=None,
        help="run secured and plain from this checkout instead (e.g. the working tree)",
    )
    parser.add_argument("--baseline-commit", default="59c427b", help="tree before security")
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        default=None,
        help="an existing checkout of the baseline (else a temporary git worktree)",
    )
    parser.add_argument("--rate", type=float, default=3.5, help="poisson phase, req/s")
    parser.add_argument("--num-requests", type=int, default=96, help="poisson phase")
    parser.add_argument("--burst-requests", type=int, default=48)
    parser.add_argument("--sequential-requests", type=int, default=8)
    parser.add_argument("--warmup-requests", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quiet-wait-s", type=float, default=60.0, help="wait for idle CPUs before a start"
    )
    parser.add_argument(
        "--max-other-share",
        type=float,
        default=0.10,
        help="a round with a run in which other processes took more of the CPUs is redone",
    )
    parser.add_argument("--max-rounds", type=int, default=0, help="0: twice --repeats")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/bench-security"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--summarize",
        type=Path,
        default=None,
        help="only recompute the medians and ratios of a results file's runs (rewrites it)",
    )
    return parser.parse_args(argv)


def write_json(path: Path, document: Json) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")


def run(args: argparse.Namespace, configs: list[ServerConfig], out: Path) -> Json:
    """Rounds of every configuration, interleaved, until each configuration had ``--repeats``
    quiet runs (other processes took at most ``--max-other-share`` of the CPUs) or
    ``--max-rounds`` ran. The JSON document of the runs, also written to ``out`` after
    every round (so a failure later keeps what was measured)."""
    args.log_dir.mkdir(parents=True, exist_ok=True)
    max_rounds = args.max_rounds or 2 * args.repeats
    runs: dict[str, list[Json]] = {config.name: [] for config in configs}
    document: Json = {
        "date": datetime.date.today().isoformat(),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor()},
        "settings": {
            key: str(value) if isinstance(value, Path) else value
            for key, value in vars(args).items()
        },
        "configs": {c.name: c.description for c in configs},
        "rounds": 0,
        "wall_s": 0.0,
        "runs": runs,
    }
    started = time.monotonic()

    def quiet_runs() -> dict[str, int]:
        return {name: sum(run["quiet"] for run in done) for name, done in runs.items()}

    while min(quiet_runs().values()) < args.repeats and document["rounds"] < max_rounds:
        for config in configs:
            log(f"round {document['rounds'] + 1}, quiet runs so far {quiet_runs()}: {config.name}")
            result = measure(config, args, document["rounds"], args.log_dir)
            result["quiet"] = result["cpu"]["other_share"] <= args.max_other_share
            if not result["quiet"]:
                log(f"  noisy: other processes took {result['cpu']['other_share']:.0%}")
            runs[config.name].append(result)
        document["rounds"] += 1
        document["wall_s"] = round(time.monotonic() - started, 1)
        write_json(out, document)
    return document


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summarize is not None:
        document = summarized(json.loads(args.summarize.read_text()))
        print_summary(document)
        write_json(args.summarize, document)
        return 0
    wanted = args.configs.split(",")
    unknown = set(wanted) - {"secured", "plain", "no-credential"}
    if unknown:
        raise SystemExit(f"unknown configurations {sorted(unknown)}")
    out = args.out or RESULTS_DIR / f"security-{datetime.date.today().isoformat()}.json"
    with contextlib.ExitStack() as stack:
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-sec-")))

        def checkout(commit: str, given: Path | None, name: str) -> Path:
            if given is not None:
                return given.resolve()
            return stack.enter_context(git_worktree(commit, directory / name))

        configs: list[ServerConfig] = []
        if {"secured", "plain"} & set(wanted):
            commit = resolve_commit(args.commit)
            tree = checkout(commit, args.tree, "tree")
            if "secured" in wanted:
                configs.append(secured_config(tree, commit, directory))
            if "plain" in wanted:
                configs.append(plain_config(tree, commit, directory))
        if "no-credential" in wanted:
            commit = resolve_commit(args.baseline_commit)
            tree = checkout(commit, args.baseline_tree, "baseline")
            configs.append(baseline_config(tree, commit, directory))
        document = run(args, configs, out)
    document = summarized(document)
    print_summary(document)
    write_json(out, document)
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
