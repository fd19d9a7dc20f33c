"""One stream at a time through ``/v1/completions``: splitserve's ``make serve`` layout at a chosen
CPU kernel level against llama.cpp's server on the same GGUF, same machine, same run.

Servers (each started alone, warmed up, then asked ``--requests`` times in turn, greedy,
``--max-tokens`` each, streamed):

- ``splitserve-<level>``: ``splitserve up --placement adaptive`` (``make serve``) with the CPU
  kernels capped at ``<level>`` (``SPLITSERVE_CPU_LEVEL``); for ``avx2`` torch is capped too
  (``ONEDNN_MAX_CPU_ISA=AVX2``, ``ATEN_CPU_CAPABILITY=avx2``), so an AVX-512 machine serves as
  an AVX2-only one would (``--dtype auto`` picks float32 there); ``native``: uncapped;
- ``...-nodrafts``: the same with prompt-lookup drafts off (``SPLITSERVE_SPECULATIVE_TOKENS=0``);
- ``llama.cpp``: ``python -m llama_cpp.server`` from ``--llama-python`` (a venv with
  ``llama-cpp-python[server]``; ``../shared/peers.md``), ``--llama-threads`` threads, on the
  default model's GGUF.

Per request: TTFT (first content chunk) and TPOT = (last chunk - first chunk) / (tokens - 1),
tokens from the response's usage where it gives them, else its chunks. Prints a row per server
(medians over requests) with the CPU's name, and writes the JSON. Nothing asserted.

    .venv/bin/python bench/bench_single_stream.py --llama-python /tmp/llama-avx2/bin/python \\
        --out bench/results/single-stream-<date>.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from bench_vs_peers import splitserve_server, wait_until_answering
from cluster_process import free_port
from machine_bound import cpu_name
from timing_stats import Json, emit_report

from splitserve.common.model_files import default_model_path
from splitserve.launch.child_process import ChildProcess

PROMPT = (
    "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle. "
    "Describe the sea, the weather and every person he meets."
)
AVX2_ENV = {
    "SPLITSERVE_CPU_LEVEL": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "ATEN_CPU_CAPABILITY": "avx2",
}


@contextlib.contextmanager
def llama_cpp_server(python: str, model: Path, threads: int, log: Path) -> Iterator[str]:
    """llama-cpp-python's OpenAI server on ``model``; yields its URL once it answers."""
    port = free_port()
    argv = [
        python, "-m", "llama_cpp.server", "--model", str(model), "--n_threads", str(threads),
        "--n_ctx", "2048", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    process = ChildProcess(argv, name="llama.cpp", log_path=log, new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_answering(process, f"{url}/v1/models", 300, log)
        yield url
    finally:
        process.stop(grace_s=10)


def one_request(url: str, model: str, max_tokens: int) -> Json:
    """One streamed greedy completion: TTFT, TPOT and the tokens it counted."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    stamps: list[float] = []
    usage_tokens = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
            if any(choice.get("text") for choice in chunk.get("choices", [])):
                stamps.append(time.perf_counter())
    tokens = usage_tokens or len(stamps)
    tpot = (stamps[-1] - stamps[0]) / (tokens - 1) if tokens > 1 and len(stamps) > 1 else None
    return {
        "ttft_ms": (stamps[0] - start) * 1e3 if stamps else None,
        "tpot_ms": None if tpot is None else tpot * 1e3,
        "tokens": tokens,
        "chunks": len(stamps),
    }


def measure(url: str, requests: int, warmup: int, max_tokens: int) -> Json:
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    for _ in range(warmup):
        one_request(url, model, max_tokens)
    runs = [one_request(url, model, max_tokens) for _ in range(requests)]
    tpots = [run["tpot_ms"] for run in runs if run["tpot_ms"] is not None]
    ttfts = [run["ttft_ms"] for run in runs if run["ttft_ms"] is not None]
    return {
        "runs": runs,
        "tpot_ms_p50": statistics.median(tpots) if tpots else None,
        "ttft_ms_p50": statistics.median(ttfts) if ttfts else None,
        "tokens_p50": statistics.median(run["tokens"] for run in runs),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", nargs="+", default=["avx2", "native"])
    parser.add_argument("--drafts", nargs="+", default=["off", "on"], choices=["off", "on"])
    parser.add_argument("--llama-python", default=None)
    parser.add_argument("--llama-threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="every server once per round")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/bench-single-stream"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    servers = []
    for level in args.levels:
        for drafts in args.drafts:
            env = dict(AVX2_ENV) if level == "avx2" else {}
            if level not in ("avx2", "native"):
                env["SPLITSERVE_CPU_LEVEL"] = level
            if drafts == "off":
                env["SPLITSERVE_SPECULATIVE_TOKENS"] = "0"
            name = f"splitserve-{level}" + ("-nodrafts" if drafts == "off" else "")
            servers.append((name, env))
    if args.llama_python:
        servers.append(("llama.cpp", {}))
    report: Json = {"cpu": cpu_name(), "prompt": PROMPT, "max_tokens": args.max_tokens}
    results: dict[str, list[Json]] = {name: [] for name, _ in servers}
    for round_index in range(args.rounds):
        for name, env in servers:
            log = args.log_dir / f"{name}-{round_index}.log"
            if name == "llama.cpp":
                server = llama_cpp_server(
                    args.llama_python, default_model_path(), args.llama_threads, log
                )
            else:
                server = splitserve_server(["--placement", "adaptive"], log, env=env)
            with server as url:
                result = measure(url, args.requests, args.warmup, args.max_tokens)
            results[name].append(result)
            print(
                f"round {round_index} {name}: TPOT p50 {result['tpot_ms_p50']:.2f} ms, "
                f"TTFT p50 {result['ttft_ms_p50']:.0f} ms, tokens {result['tokens_p50']}",
                file=sys.stderr,
                flush=True,
            )
    report["servers"] = {
        name: {
            "rounds": rounds,
            "tpot_ms_p50": statistics.median(r["tpot_ms_p50"] for r in rounds),
            "ttft_ms_p50": statistics.median(r["ttft_ms_p50"] for r in rounds),
        }
        for name, rounds in results.items()
    }
    report["env"] = {key: os.environ.get(key) for key in AVX2_ENV}
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
