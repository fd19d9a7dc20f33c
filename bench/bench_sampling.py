"""What sampling costs a decode step on the CPU: the C++ sampler against torch's, and greedy.

One engine (the default model, one core unless ``--threads``) runs bursts of chat requests
sampled at temperature 1 and top-p 0.95 (OpenAI's default temperature and a common top-p),
each seeded alike, ``--tokens`` tokens each. Three variants alternate round by round in the
same process, so each is measured beside the others:

- ``native``: the sampler as the engine builds it on the CPU (``kernels/cpu_sampling.py``:
  the filters, the draw and the logprobs in C++);
- ``torch``: the same sampler on torch's ops (``Sampler()``: the top-k of 256 candidates,
  then 4,096, then the sort; the log-sum-exp, masks, softmax, cumulative sum and search);
- ``greedy``: the same burst at temperature 0, what the step costs without sampling.

Per variant: the median over rounds of the burst's TPOT p50 and output tokens a second.
Before the bursts, ``rows``: the real logits of ``--capture`` sampled rows (the same chats),
then the microseconds a row costs each sampler (one thread) under several settings, the
C++ one at every kernel level this CPU runs, and how many rows' tokens differ from torch's
given the same uniforms.
``same_tokens``: of the requests, how many got the same tokens from both samplers in every
round (they part only where a uniform lands within float rounding of a boundary between two
tokens; then the rest of that request's tokens differ too).

    .venv/bin/python bench/bench_sampling.py --batches 8,32 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from bench_speculative import QUESTIONS
from splitserve_runner import alternated_rounds, timed_burst, write_report
from timing_stats import run_metrics

from splitserve.common.cpu_info import cpu_name
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    RunnerConfig,
    SchedulerConfig,
)
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.sampler import Sampler, SamplingRow
from splitserve.kernels.cpu_build import runnable_levels
from splitserve.kernels.cpu_sampling import load_cpu_sampling

Json = dict[str, Any]
VARIANTS = ("native", "torch", "greedy")
TOPICS = ("a dragon", "the sea", "a city at night", "a robot", "an old library", "autumn")


def chat_prompts(core: EngineCore, count: int) -> list[list[int]]:
    """``count`` different chat prompts (a question, or a story to write)."""
    tokenizer = core.tokenizer
    texts = [
        QUESTIONS[i % len(QUESTIONS)]
        if i % 2
        else f"Write a short story about {TOPICS[i % len(TOPICS)]}, #{i}."
        for i in range(count)
    ]
    return [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
        for text in texts
    ]


def one_burst(
    core: EngineCore, prompts: list[list[int]], variant: str, tokens: int, tag: str
) -> tuple[float, float, list[list[int]]]:
    """TPOT p50 (ms), output tokens a second and every request's tokens of one burst."""
    sampled = variant != "greedy"
    params = SamplingParams(
        max_tokens=tokens,
        ignore_eos=True,
        temperature=1.0 if sampled else 0.0,
        top_p=0.95 if sampled else 1.0,
        seed=7 if sampled else None,
    )
    sampler = core.runner.sampler
    kernels = sampler.kernels
    sampler.kernels = None if variant == "torch" else kernels
    try:
        burst = timed_burst(core, prompts, params, tag)
    finally:
        sampler.kernels = kernels
    metrics = run_metrics(burst.requests, burst.start, burst.end, burst.cpu_seconds)
    return metrics.tpot_p50_ms, metrics.output_tokens_per_s, [t.token_ids for t in burst.requests]


def measure(core: EngineCore, batch: int, rounds: int, tokens: int) -> Json:
    prompts = chat_prompts(core, batch)
    for variant in VARIANTS:
        one_burst(core, prompts, variant, 4, f"warm-{variant}")
    runs = alternated_rounds(
        VARIANTS,
        rounds,
        lambda variant, index: one_burst(
            core, prompts, variant, tokens, f"{variant}-{batch}-{index}"
        ),
    )
    tpot = {name: [step_ms for step_ms, _, _ in v] for name, v in runs.items()}
    rate = {name: [per_s for _, per_s, _ in v] for name, v in runs.items()}
    same = [
        all(
            native[2][i] == plain[2][i]
            for native, plain in zip(runs["native"], runs["torch"], strict=True)
        )
        for i in range(batch)
    ]
    tpot_p50 = {name: round(statistics.median(v), 2) for name, v in tpot.items()}
    return {
        "batch": batch,
        "tpot_p50_ms": tpot_p50,
        "output_tokens_per_s": {name: round(statistics.median(v), 1) for name, v in rate.items()},
        "tpot_runs_ms": {name: [round(x, 2) for x in v] for name, v in tpot.items()},
        "same_tokens": f"{sum(same)} of {batch} requests",
        "native_speedup": round(tpot_p50["torch"] / tpot_p50["native"], 3),
        "sampling_ms_per_row": {
            name: round((tpot_p50[name] - tpot_p50["greedy"]) / batch, 3)
            for name in ("native", "torch")
        },
    }


ROW_SETTINGS = (
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=1.0, top_p=0.95),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=50),
    SamplingParams(temperature=1.0, top_k=40, top_p=0.95),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=1.5, top_p=0.95),
)
"""Plain, the common top-p's, top-k, both, min-p, and a flat top-p (temperature 1.5)."""


def capture_logits(core: EngineCore, prompts: list[list[int]], count: int) -> torch.Tensor:
    """``[count, vocab]`` float32: the logits of the first ``count`` rows the engine sampled
    serving ``prompts`` at temperature 1, top-p 0.95."""
    sampler = core.runner.sampler
    seen: list[torch.Tensor] = []
    choose = sampler.choose

    def recording(logits: torch.Tensor, rows: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(logits.to(torch.float32).clone())
        return choose(logits, rows, **kwargs)

    sampler.choose = recording  # type: ignore[method-assign]
    try:
        tokens = max(1, -(-count // len(prompts)))
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=1.0, top_p=0.95)
        timed_burst(core, prompts, params, "capture")
    finally:
        sampler.choose = choose  # type: ignore[method-assign]
    return torch.cat(seen)[:count].contiguous()


def per_row_costs(logits: torch.Tensor) -> list[Json]:
    """Microseconds a row costs each sampler under each of ``ROW_SETTINGS`` (medians of 5
    passes over ``logits`` in batches of 32, one thread), and the rows whose token differs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    samplers = {"torch": Sampler()}
    for level in runnable_levels():
        kernels = load_cpu_sampling(level.name)
        if kernels is not None:
            samplers[f"native-{level.name}"] = Sampler(kernels)
    results = []
    try:
        for setting in ROW_SETTINGS:
            costs: dict[str, list[float]] = {name: [] for name in samplers}
            tokens: dict[str, list[int]] = {}
            for name, sampler in samplers.items():
                for _ in range(5):
                    drawn: list[int] = []
                    start = time.perf_counter()
                    for first in range(0, logits.shape[0], 32):
                        batch = logits[first : first + 32]
                        rows = [
                            SamplingRow(
                                setting,
                                torch.Generator().manual_seed(first + i),
                                (),
                                (),
                                frozenset(),
                            )  # fmt: skip
                            for i in range(batch.shape[0])
                        ]
                        drawn += sampler.choose(batch, rows).tolist()
                    costs[name].append((time.perf_counter() - start) / logits.shape[0] * 1e6)
                    tokens[name] = drawn
            us = {name: round(statistics.median(v), 1) for name, v in costs.items()}
            results.append({
                "setting": {"temperature": setting.temperature, "top_k": setting.top_k,
                            "top_p": setting.top_p, "min_p": setting.min_p},
                "us_per_row": us,
                "rows_differing_from_torch": {
                    name: sum(a != b for a, b in zip(tokens[name], tokens["torch"], strict=True))
                    for name in samplers if name != "torch"
                },
            })  # fmt: skip
            print(json.dumps(results[-1]), flush=True)
    finally:
        torch.set_num_threads(threads)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="8,32", help="comma-separated batch sizes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48, help="tokens per request")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--capture", type=int, default=640, help="rows for the per-row costs")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    core = EngineCore(
        EngineConfig(
            model=ModelConfig(model="default", dtype="auto"),
            runner=RunnerConfig(num_threads=args.threads),
            cache=CacheConfig(num_blocks=2048),
            scheduler=SchedulerConfig(max_num_seqs=256),
        )
    )
    report: Json = {
        "cpu": cpu_name(),
        "threads": args.threads,
        "native_sampler": core.runner.sampler.kernels is not None,
        "vocab": core.model_config.vocab_size,
        "sampling": {"temperature": 1.0, "top_p": 0.95, "tokens": args.tokens},
        "rows": [],
        "batches": [],
    }
    if args.capture:
        logits = capture_logits(core, chat_prompts(core, 16), args.capture)
        report["rows"] = per_row_costs(logits)
    for batch in (int(b) for b in args.batches.split(",")):
        row = measure(core, batch, args.rounds, args.tokens)
        print(json.dumps(row), flush=True)
        report["batches"].append(row)
    write_report(report, args.out, "sampling")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
