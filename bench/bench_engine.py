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

Usage: ``python bench/bench_engine.py [--levels 1,16,64] [--reps N] [--hf-reps N] [--skip-hf]``
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from splitserve.engine.checkpoint import default_model_path
from splitserve.engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    RunnerConfig,
    SchedulerConfig,
)
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.sampling_params import SamplingParams

PROMPT_TOKEN_RANGE = (1000, 40000)
DEFAULT_REPS = {"splitserve": {1: 5, 16: 3, 64: 2}, "hf_transformers": {1: 3, 16: 2, 64: 1}}
SYSTEMS = tuple(DEFAULT_REPS)
BANDWIDTH_BYTES = 1 << 30
BANDWIDTH_REPEATS = 5
QUIET_BUSY_FRACTION = 0.1
CONTENDED_CPU_SHARE = 0.8

Json = dict[str, Any]


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# ---- timings and their statistics -------------------------------------------------------------


@dataclass
class RequestTiming:
    """When one request was submitted, and when each of its output tokens came back."""

    submit_time: float
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class RunMetrics:
    """One repetition at one concurrency level (times in ms, throughput in tokens/s)."""

    output_tokens_per_s: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    wall_s: float
    cpu_share: float
    """Process CPU time / (wall * torch threads): well below 1 means other processes competed."""


@dataclass(frozen=True)
class RunResult:
    """One repetition: its metrics, request 0's output tokens and system-specific checks."""

    metrics: RunMetrics
    first_output: list[int]
    checks: Json


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def run_metrics(
    timings: Sequence[RequestTiming], start: float, end: float, cpu_seconds: float
) -> RunMetrics:
    """Throughput, TPOT and TTFT percentiles of one burst of requests."""
    done = [t for t in timings if t.token_times]
    ttfts = [(t.token_times[0] - t.submit_time) * 1e3 for t in done]
    tpots = [
        (t.token_times[-1] - t.token_times[0]) * 1e3 / (len(t.token_times) - 1)
        for t in done
        if len(t.token_times) > 1
    ]
    wall = end - start
    return RunMetrics(
        output_tokens_per_s=sum(len(t.token_times) for t in timings) / wall,
        tpot_p50_ms=percentile(tpots, 50),
        tpot_p99_ms=percentile(tpots, 99),
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p99_ms=percentile(ttfts, 99),
        wall_s=wall,
        cpu_share=cpu_seconds / (wall * torch.get_num_threads()),
    )


def medians(runs: Sequence[RunMetrics]) -> Json:
    values = {name: statistics.median(getattr(r, name) for r in runs) for name in asdict(runs[0])}
    return {name: round(value, 3) for name, value in values.items()} | {"reps": len(runs)}


def summarize(runs: Sequence[RunMetrics]) -> Json:
    """Medians over all repetitions, and over the uncontended ones alone (None if none was)."""
    clean = [r for r in runs if r.cpu_share >= CONTENDED_CPU_SHARE]
    return medians(runs) | {"uncontended": medians(clean) if clean else None}


def headline(row: Json) -> Json:
    """The figures a level is judged by: uncontended medians where there are any."""
    return row["uncontended"] or row


def machine_busy_fraction(sample_s: float = 1.0) -> float | None:
    """Fraction of all CPUs busy over ``sample_s`` (from /proc/stat); None where unreadable."""

    def ticks() -> tuple[int, int]:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        return sum(values), values[3] + values[4]  # total, idle + iowait

    try:
        total_before, idle_before = ticks()
        time.sleep(sample_s)
        total_after, idle_after = ticks()
    except (OSError, ValueError, IndexError):
        return None
    total = total_after - total_before
    return 1.0 - (idle_after - idle_before) / total if total else None


def wait_for_quiet(max_wait_s: float) -> float | None:
    """While idle, wait up to ``max_wait_s`` for other processes to leave the CPUs idle.

    Returns the last busy fraction seen (None where /proc/stat is unreadable).
    """
    deadline = time.monotonic() + max_wait_s
    busy = machine_busy_fraction() if max_wait_s > 0 else None
    while busy is not None and busy > QUIET_BUSY_FRACTION and time.monotonic() < deadline:
        busy = machine_busy_fraction()
    return busy


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


def build_engine(threads: int, kv_cache_gib: float) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=ModelConfig(model="default", dtype="auto"),
            runner=RunnerConfig(num_threads=threads),
            cache=CacheConfig(kv_cache_gib=kv_cache_gib),
            scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256),
        )
    )


def run_burst(core: EngineCore, prompts: list[list[int]], max_tokens: int, tag: str) -> RunResult:
    """Submit every prompt at once, step until all finish, then check the KV pool is whole."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    timings: dict[str, RequestTiming] = {}
    cached_tokens = 0
    cpu_start, start = time.process_time(), time.perf_counter()
    for index, prompt in enumerate(prompts):
        timings[f"{tag}-{index}"] = RequestTiming(submit_time=time.perf_counter())
        core.add_request(f"{tag}-{index}", prompt, params)
    while core.has_unfinished:
        outputs = core.step()
        now = time.perf_counter()
        for out in outputs:
            timing = timings[out.update.request_id]
            if not timing.token_times:
                cached_tokens += out.update.num_cached_tokens
            timing.token_times.extend(now for _ in out.update.new_token_ids)
            timing.token_ids.extend(out.update.new_token_ids)
    end, cpu_seconds = time.perf_counter(), time.process_time() - cpu_start
    requests = list(timings.values())
    checks = {
        "kv_blocks_freed": core.kv_cache.num_free_blocks == core.kv_cache.num_blocks,
        "prefix_cache_hit_tokens": cached_tokens,
        "requests_with_wrong_output_len": sum(len(t.token_ids) != max_tokens for t in requests),
    }
    return RunResult(run_metrics(requests, start, end, cpu_seconds), requests[0].token_ids, checks)


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
    weights = weight_read_bytes(core.checkpoint.weights, core.model_config.tie_word_embeddings)
    return results, weights, first_output


def num_preemptions(core: EngineCore) -> int:
    return getattr(getattr(core.scheduler, "stats", None), "num_preemptions", 0)


# ---- HF transformers --------------------------------------------------------------------------


def load_hf_model() -> Any:
    """The default GGUF, dequantized into a dense bf16 ``LlamaForCausalLM`` (no packed kernels)."""
    from transformers import AutoModelForCausalLM, GgufConfig

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent),
        gguf_file=path.name,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    )
    return model.eval()


def make_step_timer(stamps: list[float]) -> Any:
    """A ``StoppingCriteria`` that never stops and records when each generated token exists."""
    from transformers import StoppingCriteria

    class StepTimer(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    return StepTimer()


def run_hf_batch(model: Any, prompts: list[list[int]], max_tokens: int) -> RunResult:
    """One static batch through ``model.generate``; every row shares the step timestamps."""
    from transformers import StoppingCriteriaList

    input_ids = torch.tensor(prompts, dtype=torch.long)  # [batch, prompt_len]
    stamps: list[float] = []
    cpu_start, start = time.process_time(), time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            pad_token_id=model.config.eos_token_id,
            stopping_criteria=StoppingCriteriaList([make_step_timer(stamps)]),
        )
    end, cpu_seconds = time.perf_counter(), time.process_time() - cpu_start
    new_tokens = output[:, input_ids.shape[1] :]  # [batch, generated]
    timings = [RequestTiming(start, list(stamps)) for _ in prompts]
    checks = {"requests_with_wrong_output_len": len(prompts) * (len(stamps) != max_tokens)}
    return RunResult(run_metrics(timings, start, end, cpu_seconds), new_tokens[0].tolist(), checks)


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


def greedy_agreement(ours: list[int], theirs: list[int]) -> Json:
    """How many leading output tokens of the first measured request match HF's (bf16 noise)."""
    matching = 0
    for a, b in zip(ours, theirs, strict=False):
        if a != b:
            break
        matching += 1
    return {"matching_prefix_tokens": matching, "compared_tokens": min(len(ours), len(theirs))}


# ---- bandwidth floor --------------------------------------------------------------------------


def weight_read_bytes(weights: dict[str, torch.Tensor], tied: bool) -> Json:
    """Bytes of weight matrices one decode step reads: decoder layer matrices + LM head once."""
    layer_bytes = sum(
        t.numel() * t.element_size()
        for name, t in weights.items()
        if name.startswith("model.layers.") and t.dim() == 2
    )
    head = weights["model.embed_tokens.weight" if tied else "lm_head.weight"]
    head_bytes = head.numel() * head.element_size()
    return {
        "decoder_layer_matrix_bytes": layer_bytes,
        "lm_head_bytes": head_bytes,
        "bytes_per_decode_step": layer_bytes + head_bytes,
        "weight_dtype": str(head.dtype).removeprefix("torch."),
    }


def read_bandwidth_gbps() -> float:
    """Read bandwidth of ``.sum()`` over a 1 GiB float32 tensor, median of 5, in GB/s."""
    data = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32)
    data.sum()  # warm-up
    seconds = []
    for _ in range(BANDWIDTH_REPEATS):
        start = time.perf_counter()
        data.sum()
        seconds.append(time.perf_counter() - start)
    return BANDWIDTH_BYTES / statistics.median(seconds) / 1e9


def floor_of(weights: Json, bandwidths_gbps: Sequence[float]) -> Json:
    """The floor uses the best of the measurements: contention only lowers bandwidth."""
    bandwidth = max(bandwidths_gbps)
    floor_ms = weights["bytes_per_decode_step"] / (bandwidth * 1e9) * 1e3
    return weights | {
        "read_bandwidth_gbps": round(bandwidth, 2),
        "read_bandwidth_gbps_at_start_and_end": [round(b, 2) for b in bandwidths_gbps],
        "bandwidth_method": "torch.sum over a 1 GiB float32 tensor, median of 5, "
        "measured at the start and the end of the bench; the higher one is used",
        "floor_tpot_ms": round(floor_ms, 3),
    }


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
