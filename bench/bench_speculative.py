"""Speculative decoding by prompt lookup: TPOT with and without, same run, same engine settings.

One process, two ``EngineCore``\\ s over the default model (bf16 where the CPU has it, one torch
thread: a decode worker's core), identical but for ``SpeculativeConfig.num_tokens`` (0 and
``--drafts``). Workloads, each with ``streams`` requests submitted at once (1 and 4), greedy,
at most ``--max-tokens`` tokens, stopping at EOS:

- ``code-edit``: a short Python function and "rename it and give the whole code back": the
  answer copies most of the prompt;
- ``summarise``: a paragraph and "summarise it, quoting its key sentences";
- ``chat``: plain questions, whose answers rarely repeat the prompt (the case where drafts
  are seldom proposed and seldom kept).

Each token is stamped when the step that produced it returns; TPOT per request = (last token -
first token) / (tokens - 1), median over requests (``timing_stats.run_metrics``), then median
over ``--reps`` repetitions, plain and speculative alternating. Also: the acceptance rate
(drafts kept / drafts verified, from the scheduler's counters) and whether both engines gave
the same tokens (they must: greedy speculation is exact). Before each run the bench waits up
to ``--wait-quiet-s`` for the CPUs to go idle and records the run's CPU share. Prints the
table to stderr and the JSON report to stdout (``--out`` writes it too). Nothing asserted.

    .venv/bin/python bench/bench_speculative.py --out bench/results/speculative-<date>.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
from collections.abc import Sequence
from pathlib import Path

import torch
from splitserve_runner import timed_burst
from timing_stats import Json, emit_report, log_row, run_metrics, wait_for_quiet

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    RunnerConfig,
    SpeculativeConfig,
)
from splitserve.engine.engine_core import EngineCore

FUNCTIONS = [
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(values)\n",
    "def clamp(x, low, high):\n    if x < low:\n        return low\n    if x > high:\n"
    "        return high\n    return x\n",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n"
    "        counts[word] = counts.get(word, 0) + 1\n    return counts\n",
    "def is_palindrome(word):\n    word = word.lower()\n    return word == word[::-1]\n",
]
PARAGRAPHS = [
    "The lighthouse keeper climbed the spiral stairs each evening. He trimmed the wick and "
    "polished the great lens. The beam swept over the dark water and marked the rocks.",
    "Bees visit thousands of flowers every day. They carry pollen from one plant to the next. "
    "Without them many fruits and vegetables would not grow.",
    "The river rose after three days of rain. Farmers moved their animals to higher ground. "
    "By morning the water had covered the lower fields.",
    "The library opened a new reading room for children. It has soft chairs and bright "
    "windows. Every Saturday a volunteer reads stories aloud.",
]
QUESTIONS = [
    "What is the capital of France?",
    "Give three tips for better sleep.",
    "Explain photosynthesis in simple terms.",
    "Write a short poem about the sea.",
]


def workloads() -> dict[str, list[str]]:
    return {
        "code-edit": [
            f"{code}\nRename the function to `renamed` and give the whole code back."
            for code in FUNCTIONS
        ],
        "summarise": [
            f"{text}\n\nSummarise the text above, quoting its key sentences." for text in PARAGRAPHS
        ],
        "chat": QUESTIONS,
    }


def build_engine(drafts: int) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=ModelConfig(model="default", dtype="auto"),
            cache=CacheConfig(num_blocks=2048),
            runner=RunnerConfig(num_threads=1),
            speculative=SpeculativeConfig(num_tokens=drafts),
        )
    )


def run_once(core: EngineCore, prompts: list[list[int]], max_tokens: int, tag: str) -> Json:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    stats_before = core.scheduler.stats
    burst = timed_burst(core, prompts, params, tag)
    stats = core.scheduler.stats
    metrics = run_metrics(burst.requests, burst.start, burst.end, burst.cpu_seconds)
    return {
        "tpot_p50_ms": metrics.tpot_p50_ms,
        "output_tokens_per_s": metrics.output_tokens_per_s,
        "cpu_share": metrics.cpu_share,
        "draft_tokens": stats.num_draft_tokens - stats_before.num_draft_tokens,
        "accepted_tokens": stats.num_accepted_draft_tokens - stats_before.num_accepted_draft_tokens,
        "outputs": [timing.token_ids for timing in burst.requests],
    }


def run(args: argparse.Namespace) -> Json:
    engines = {"plain": build_engine(0), "speculative": build_engine(args.drafts)}
    tokenizer = engines["plain"].tokenizer
    report: Json = {
        "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__},
        "setup": {
            "dtype": str(engines["plain"].dtype),
            "threads": 1,
            "drafts": args.drafts,
            "max_tokens": args.max_tokens,
            "reps": args.reps,
        },
        "results": [],
    }
    for name, texts in workloads().items():
        prompts = [
            tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
            for text in texts
        ]
        for streams in args.streams:
            runs: dict[str, list[Json]] = {"plain": [], "speculative": []}
            for rep in range(args.reps):
                for kind, core in engines.items():
                    wait_for_quiet(args.wait_quiet_s)
                    tag = f"{name}-{streams}-{rep}-{kind}"
                    runs[kind].append(run_once(core, prompts[:streams], args.max_tokens, tag))
            row = summarize(name, streams, runs)
            log_row(row)
            report["results"].append(row)
    return report


def summarize(name: str, streams: int, runs: dict[str, list[Json]]) -> Json:
    plain, spec = runs["plain"], runs["speculative"]
    drafts = sum(r["draft_tokens"] for r in spec)
    accepted = sum(r["accepted_tokens"] for r in spec)
    plain_tpot = statistics.median(r["tpot_p50_ms"] for r in plain)
    spec_tpot = statistics.median(r["tpot_p50_ms"] for r in spec)
    return {
        "workload": name,
        "streams": streams,
        "plain_tpot_ms": round(plain_tpot, 2),
        "speculative_tpot_ms": round(spec_tpot, 2),
        "speedup": round(plain_tpot / spec_tpot, 3),
        "plain_tpot_per_rep": [round(r["tpot_p50_ms"], 2) for r in plain],
        "speculative_tpot_per_rep": [round(r["tpot_p50_ms"], 2) for r in spec],
        "acceptance": round(accepted / drafts, 3) if drafts else None,
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "tokens_per_request": statistics.median(len(o) for r in plain for o in r["outputs"]),
        "same_tokens": all(p["outputs"] == s["outputs"] for p, s in zip(plain, spec, strict=True)),
        "min_cpu_share": round(min(r["cpu_share"] for r in plain + spec), 2),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafts", type=int, default=4, help="draft tokens per step")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--wait-quiet-s", type=float, default=20.0)
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    emit_report(run(args), args.out)


if __name__ == "__main__":
    main()
