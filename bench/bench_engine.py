"""Engine benchmark: splitserve's ``EngineCore`` against HF transformers and the bandwidth floor.

Prints one JSON document to stdout (progress and a compact table go to stderr). Everything is
measured in one process on this machine, with the same torch thread count (default 2):

1. **splitserve**: at each concurrency level N (default 1, 16, 64), N requests of 256 prompt and
   128 output tokens (greedy, ``ignore_eos``, dtype "auto" = bf16 on CPUs with native bf16) are
   submitted at once (burst) to one ``EngineCore`` driven by ``step()``; each token is stamped
   with ``time.perf_counter()`` when the step that produced it returns. TTFT = first token -
   submit; TPOT per request = (last token - first token) / (tokens - 1); throughput = all output
   tokens / (last finish - first submit). Each repetition also records whether every KV block
   came back to the pool. Prompts are random token ids in [1000, 40000) from a fixed seed,
   distinct per request and per repetition, so the prefix cache cannot help (its hits are
   recorded to show it).
2. **HF transformers**: the same GGUF dequantized into a dense bf16 ``LlamaForCausalLM``;
   ``model.generate`` (greedy, ``min_new_tokens = max_new_tokens = 128``) on a static batch of
   the same prompts (equal lengths, no padding). A ``StoppingCriteria`` that never stops stamps
   every step; the metrics are computed as above (throughput = batch * 128 / wall).
3. **Bandwidth floor**: bytes of weights one decode step reads (every weight matrix of the
   decoder layers plus the LM head matrix once, tied or not; the embedding lookup reads one
   row) divided by the read bandwidth of ``.sum()`` over a 1 GiB float32 tensor (median of 5,
   at the start and at the end; the higher one counts): the TPOT one stream cannot beat here.

Each metric is the median over repetitions (fewer at high concurrency, where one HF repetition
takes minutes). The machine is shared: with two threads on two cores, any other busy process
stalls torch's OpenMP loops far beyond its own share. So before each run the bench waits (up
to ``--wait-quiet-s``) for the CPUs to go idle, and records the busy fraction it saw and the
run's CPU share (process CPU time / (wall * threads)); a share below 0.8 marks a contended run.
Each level reports medians over all reps and over its uncontended reps; the table and the
ratios use the latter where there are any. Nothing is asserted: the bench only measures.

Modules (siblings of this script, imported as top-level modules since the script's folder is
on ``sys.path``): ``timing_stats`` (TTFT/TPOT/throughput, medians, CPU share, waiting for a
quiet machine), ``splitserve_runner`` (a burst through ``EngineCore``), ``hf_baseline`` (a
static batch through ``model.generate``) and ``bandwidth_floor`` (bytes per decode step and
read bandwidth). This script parses arguments, runs the levels and writes the report.

Usage: ``python bench/bench_engine.py [--levels 1,16,64] [--reps N] [--hf-reps N] [--skip-hf]``
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from bandwidth_floor import floor_of, read_bandwidth_gbps, weight_read_bytes
from hf_baseline import greedy_agreement, load_hf_model, run_hf_batch
from splitserve_runner import build_engine, num_preemptions, run_burst
from timing_stats import Json, RunMetrics, RunResult, headline, summarize, wait_for_quiet

from splitserve.common.model_files import default_model_path
from splitserve.engine.checkpoint import load_checkpoint

PROMPT_TOKEN_RANGE = (1000, 40000)
DEFAULT_REPS = {"splitserve": {1: 5, 16: 3, 64: 2}, "hf_transformers": {1: 3, 16: 2, 64: 1}}
SYSTEMS = tuple(DEFAULT_REPS)


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# ---- the level loop, shared by both systems -------------------------------------------------


def make_prompts(num_prompts: int, prompt_len: int, seed: int) -> list[list[int]]:
    """Random token ids in ``PROMPT_TOKEN_RANGE``, one distinct prompt per request."""
    rng = random.Random(seed)
    low, high = PROMPT_TOKEN_RANGE
    return [[rng.randrange(low, high) for _ in range(prompt_len)] for _ in range(num_prompts)]


def reps_for(system: str, level: int, args: argparse.Namespace) -> int:
    """``--hf-reps`` for HF, else ``--reps`` (which only lowers HF's defaults), else defaults."""
    default = DEFAULT_REPS[system].get(level, 1)
    if system == "hf_transformers":
        return args.hf_reps or min(default, args.reps or default)
    return args.reps or default


def bench_levels(
    system: str, run_once: Callable[[list[list[int]], str], RunResult], args: argparse.Namespace
) -> tuple[Json, list[int]]:
    """Every level's repetitions; repetition r at level N uses the same prompts in both systems.

    A level that raises is reported as ``{"error": ...}`` and ends this system's run. Also
    returns request 0's output in the first repetition of the first level.
    """
    results: Json = {}
    first_output: list[int] = []
    for level in args.levels:
        runs: list[RunMetrics] = []
        per_rep: list[Json] = []
        try:
            for rep in range(reps_for(system, level, args)):
                prompts = make_prompts(level, args.input_len, args.seed + 1000 * level + rep)
                busy = wait_for_quiet(args.wait_quiet_s)
                result = run_once(prompts, f"c{level}-r{rep}")
                runs.append(result.metrics)
                first_output = first_output or result.first_output
                per_rep.append(rep_record(result, busy))
                log(f"{system} c={level} rep {rep + 1}: {per_rep[-1]}")
        except Exception as error:  # a crashed level is part of the report
            log(f"{system} c={level} FAILED: {error!r}")
            results[str(level)] = {"error": repr(error), "per_rep": per_rep}
            break
        results[str(level)] = summarize(runs) | {"per_rep": per_rep}
    return results, first_output


def rep_record(result: RunResult, busy_before: float | None) -> Json:
    return {
        "output_tokens_per_s": round(result.metrics.output_tokens_per_s, 2),
        "cpu_share": round(result.metrics.cpu_share, 2),
        "machine_busy_before": None if busy_before is None else round(busy_before, 2),
        **result.checks,
    }


# ---- splitserve -------------------------------------------------------------------------------


def bench_splitserve(args: argparse.Namespace) -> tuple[Json, Json, list[int]]:
    """Load the engine, warm up, run every level; returns (results, weight bytes, ref tokens)."""
    load_start = time.perf_counter()
    core = build_engine(args.threads, args.kv_cache_gib)
    log(f"splitserve engine loaded in {time.perf_counter() - load_start:.1f} s ({core.dtype})")
    run_burst(core, make_prompts(1, 32, args.seed - 1), 8, "warmup")
    preemptions_before = num_preemptions(core)

    def run_once(prompts: list[list[int]], tag: str) -> RunResult:
        return run_burst(core, prompts, args.output_len, tag)

    levels, first_output = bench_levels("splitserve", run_once, args)
    pool_whole = core.kv_cache.num_free_blocks == core.kv_cache.num_blocks
    for row in levels.values():  # a crashed level leaves its requests (and blocks) behind
        freed = all(rep["kv_blocks_freed"] for rep in row["per_rep"])
        row["all_kv_blocks_freed"] = freed and ("error" not in row or pool_whole)
    results: Json = {
        "engine_dtype": str(core.dtype).removeprefix("torch."),
        "kv_blocks": core.kv_cache.num_blocks,
        "num_preemptions": num_preemptions(core) - preemptions_before,
        **levels,
    }
    dense = load_checkpoint(default_model_path(), core.dtype).weights  # the engine keeps none
    weights = weight_read_bytes(dense, core.model_config.tie_word_embeddings)
    return results, weights, first_output


# ---- HF transformers --------------------------------------------------------------------------


def bench_hf(args: argparse.Namespace, reference_tokens: list[int]) -> Json:
    """Every level with ``model.generate`` on the same prompts as splitserve's repetitions."""
    load_start = time.perf_counter()
    model = load_hf_model()
    log(f"HF model loaded in {time.perf_counter() - load_start:.1f} s")
    run_hf_batch(model, make_prompts(1, 32, args.seed - 1), 8)

    def run_once(prompts: list[list[int]], tag: str) -> RunResult:
        return run_hf_batch(model, prompts, args.output_len)

    levels, first_output = bench_levels("hf_transformers", run_once, args)
    agreement = greedy_agreement(reference_tokens, first_output)
    return {"model_class": type(model).__name__, "greedy_agreement": agreement, **levels}


# ---- report -----------------------------------------------------------------------------------


def machine_info(threads: int) -> Json:
    import transformers

    try:
        cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines()
    except OSError:
        cpuinfo = []
    names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    return {
        "cpu": names[0] if names else platform.processor(),
        "logical_cpus": os.cpu_count(),
        "avx512_bf16": "avx512_bf16" in flags,
        "torch_threads": threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
    }


def level_rows(results: Json | None) -> dict[str, Json]:
    """The measured (not crashed) levels of one system's results."""
    return {k: v for k, v in (results or {}).items() if k.isdigit() and "error" not in v}


def ratios(floor: Json, ours: Json, hf: Json | None) -> Json:
    ours_rows, hf_rows = level_rows(ours), level_rows(hf)
    result: Json = {"goal_tpot_over_floor_max": 1.5, "goal_throughput_over_hf_at_64_min": 1.5}
    result["basis"] = "medians of uncontended reps where a level has any, else of all reps"
    if "1" in ours_rows:
        tpot = headline(ours_rows["1"])["tpot_p50_ms"]
        result["splitserve_tpot_p50_at_1_over_floor"] = round(tpot / floor["floor_tpot_ms"], 3)
    for level in sorted(ours_rows.keys() & hf_rows.keys(), key=int):
        ours_tps = headline(ours_rows[level])["output_tokens_per_s"]
        speedup = ours_tps / headline(hf_rows[level])["output_tokens_per_s"]
        result[f"splitserve_over_hf_throughput_at_{level}"] = round(speedup, 3)
    return result


def print_table(report: Json) -> None:
    """Headline figures per level; ``reps`` is uncontended/all, cpu the median CPU share."""
    lines = [
        f"{'system':<12}{'conc':>5}{'tok/s':>9}{'TPOT p50':>10}{'p99':>8}"
        f"{'TTFT p50':>10}{'p99':>9}{'wall s':>8}{'reps':>6}{'cpu':>6}"
    ]
    contended = []
    for system in SYSTEMS:
        for level, row in level_rows(report[system]).items():
            best = headline(row)
            clean_reps = row["uncontended"]["reps"] if row["uncontended"] else 0
            reps = f"{clean_reps}/{row['reps']}"
            lines.append(
                f"{system[:11]:<12}{level:>5}{best['output_tokens_per_s']:>9.1f}"
                f"{best['tpot_p50_ms']:>10.1f}{best['tpot_p99_ms']:>8.1f}"
                f"{best['ttft_p50_ms']:>10.0f}{best['ttft_p99_ms']:>9.0f}"
                f"{best['wall_s']:>8.1f}{reps:>6}{best['cpu_share']:>6.2f}"
            )
            if clean_reps == 0:
                contended.append(f"{system} c={level}")
        for level, row in (report[system] or {}).items():
            if isinstance(row, dict) and "error" in row:
                lines.append(f"{system} c={level} FAILED: {row['error']}")
    if contended:
        lines.append(
            f"WARNING: every rep was contended (figures unreliable): {', '.join(contended)}"
        )
    floor = report["floor"]
    lines.append(
        f"floor: {floor['bytes_per_decode_step'] / 1e6:.1f} MB/step at "
        f"{floor['read_bandwidth_gbps']:.1f} GB/s = {floor['floor_tpot_ms']:.2f} ms"
    )
    lines += [f"{key}: {value}" for key, value in report["ratios"].items()]
    print("\n".join(lines), file=sys.stderr, flush=True)


def workload(args: argparse.Namespace) -> Json:
    low, high = PROMPT_TOKEN_RANGE
    return {
        "input_tokens": args.input_len,
        "output_tokens": args.output_len,
        "arrivals": "burst (all requests of a level submitted at once)",
        "sampling": "greedy (temperature 0), ignore_eos",
        "prompts": f"random token ids in [{low}, {high}), seed {args.seed}, distinct per request "
        "and repetition (no prefix-cache reuse); HF gets the same prompts",
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,16,64", help="comma-separated concurrency levels")
    parser.add_argument("--reps", type=int, help="repetitions per level (caps HF's defaults)")
    parser.add_argument("--hf-reps", type=int, help="HF repetitions per level")
    parser.add_argument("--skip-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--wait-quiet-s",
        type=float,
        default=20.0,
        help="before each run, wait up to this long for the CPUs to go idle (0: don't wait)",
    )
    args = parser.parse_args(argv)
    args.levels = [int(level) for level in args.levels.split(",") if level.strip()]
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    bench_start = time.perf_counter()
    report: Json = {"machine": machine_info(args.threads), "model": default_model_path().name}
    wait_for_quiet(args.wait_quiet_s)
    bandwidths = [read_bandwidth_gbps()]
    log(f"read bandwidth {bandwidths[0]:.1f} GB/s")
    ours, weights, reference_tokens = bench_splitserve(args)
    gc.collect()  # the engine and its KV cache go before the HF model loads
    hf = None if args.skip_hf else bench_hf(args, reference_tokens)
    wait_for_quiet(args.wait_quiet_s)
    bandwidths.append(read_bandwidth_gbps())
    floor = floor_of(weights, bandwidths)
    report |= {
        "dtype": ours.pop("engine_dtype"),
        "workload": workload(args),
        "floor": floor,
        "splitserve": ours,
        "hf_transformers": hf,
        "ratios": ratios(floor, ours, hf),
        "bench_wall_s": round(time.perf_counter() - bench_start, 1),
    }
    report["machine"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    print_table(report)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
