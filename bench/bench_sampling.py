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
``same_tokens``: of the requests, how many got the same tokens from both samplers in every
round (they part only where a uniform lands within float rounding of a boundary between two
tokens; then the rest of that request's tokens differ too).

    .venv/bin/python bench/bench_sampling.py --batches 8,32 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import date
from pathlib import Path
from typing import Any

from bench_speculative import QUESTIONS
from splitserve_runner import timed_burst
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

Json = dict[str, Any]
RESULTS = Path(__file__).resolve().parent / "results"
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
    tpot: dict[str, list[float]] = {name: [] for name in VARIANTS}
    rate: dict[str, list[float]] = {name: [] for name in VARIANTS}
    same = [True] * batch
    for round_index in range(rounds):
        outputs: dict[str, list[list[int]]] = {}
        order = VARIANTS if round_index % 2 == 0 else tuple(reversed(VARIANTS))
        for variant in order:
            tag = f"{variant}-{batch}-{round_index}"
            step_ms, per_s, outputs[variant] = one_burst(core, prompts, variant, tokens, tag)
            tpot[variant].append(step_ms)
            rate[variant].append(per_s)
        for i, (native, plain) in enumerate(zip(outputs["native"], outputs["torch"], strict=True)):
            same[i] = same[i] and native == plain
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="8,32", help="comma-separated batch sizes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48, help="tokens per request")
    parser.add_argument("--threads", type=int, default=1)
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
        "batches": [],
    }
    for batch in (int(b) for b in args.batches.split(",")):
        row = measure(core, batch, args.rounds, args.tokens)
        print(json.dumps(row), flush=True)
        report["batches"].append(row)
    out = args.out or RESULTS / f"sampling-{date.today().isoformat()}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
