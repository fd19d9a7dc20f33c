"""What top-p sampling costs a decode step on the CPU: the nucleus tiers against the tree before.

One engine (the default model, one core unless ``--threads``) runs bursts of chat requests
sampled at temperature 1 and top-p 0.95 (OpenAI's default temperature and a common top-p),
each seeded alike, ``--tokens`` tokens each. Three variants alternate round by round in the
same process, so each is measured beside the others:

- ``tiers``: the sampler as it is (``engine/sampler.py:_NUCLEUS_TIERS``, 256 then 4,096
  candidates, then the sort of the vocabulary);
- ``sort-after-256``: the tree before: 256 candidates, then the sort;
- ``greedy``: the same burst at temperature 0, what the step costs without sampling.

Per variant: the median over rounds of the burst's TPOT p50 and output tokens a second. The two
sampled variants must give every request the same tokens (``same_tokens``: a tier's cut-off is
the sort's). ``rows`` counts the sampled rows whose nucleus lay beyond 256 candidates and
beyond 4,096, over the ``tiers`` rounds.

    .venv/bin/python bench/bench_sampling.py --batches 8,32 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import date
from pathlib import Path
from typing import Any

import torch
from bench_speculative import QUESTIONS
from splitserve_runner import timed_burst
from timing_stats import run_metrics

from splitserve.common.cpu_info import cpu_name
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine import sampler as sampler_module
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
VARIANTS = ("tiers", "sort-after-256", "greedy")
TOPICS = ("a dragon", "the sea", "a city at night", "a robot", "an old library", "autumn")


class RowCounts:
    """Sampled rows that went past the first tier, and past the second to the sort."""

    def __init__(self) -> None:
        self.beyond_first = 0
        self.beyond_second = 0

    @contextmanager
    def counting(self) -> Iterator[None]:
        """Count, while open, the rows each later tier and the sort were asked to decide."""
        original = sampler_module._NucleusRows.cutoff_among
        counts = self

        def counted(
            nucleus: Any, rows: torch.Tensor, redo: torch.Tensor, values: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if values.shape[1] == rows.shape[1]:
                counts.beyond_second += rows.shape[0]
            else:
                counts.beyond_first += rows.shape[0]
            return original(nucleus, rows, redo, values)

        sampler_module._NucleusRows.cutoff_among = counted  # type: ignore[method-assign]
        try:
            yield
        finally:
            sampler_module._NucleusRows.cutoff_among = original  # type: ignore[method-assign]


@contextmanager
def tiers(widths: tuple[int, ...]) -> Iterator[None]:
    original = sampler_module._NUCLEUS_TIERS
    sampler_module._NUCLEUS_TIERS = widths
    try:
        yield
    finally:
        sampler_module._NUCLEUS_TIERS = original


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
    widths = (256,) if variant == "sort-after-256" else sampler_module._NUCLEUS_TIERS
    with tiers(widths):
        burst = timed_burst(core, prompts, params, tag)
    metrics = run_metrics(burst.requests, burst.start, burst.end, burst.cpu_seconds)
    return metrics.tpot_p50_ms, metrics.output_tokens_per_s, [t.token_ids for t in burst.requests]


def measure(core: EngineCore, batch: int, rounds: int, tokens: int) -> Json:
    prompts = chat_prompts(core, batch)
    one_burst(core, prompts, "tiers", 4, "warm")
    tpot: dict[str, list[float]] = {name: [] for name in VARIANTS}
    rate: dict[str, list[float]] = {name: [] for name in VARIANTS}
    same = True
    counts = RowCounts()
    for round_index in range(rounds):
        outputs: dict[str, list[list[int]]] = {}
        order = VARIANTS if round_index % 2 == 0 else tuple(reversed(VARIANTS))
        for variant in order:
            tag = f"{variant}-{batch}-{round_index}"
            if variant == "tiers":
                with counts.counting():
                    step_ms, per_s, outputs[variant] = one_burst(
                        core, prompts, variant, tokens, tag
                    )
            else:
                step_ms, per_s, outputs[variant] = one_burst(core, prompts, variant, tokens, tag)
            tpot[variant].append(step_ms)
            rate[variant].append(per_s)
        same = same and outputs["tiers"] == outputs["sort-after-256"]
    sampled_rows = rounds * batch * tokens
    result: Json = {
        "batch": batch,
        "tpot_p50_ms": {name: round(statistics.median(v), 2) for name, v in tpot.items()},
        "output_tokens_per_s": {name: round(statistics.median(v), 1) for name, v in rate.items()},
        "tpot_runs_ms": {name: [round(x, 2) for x in v] for name, v in tpot.items()},
        "same_tokens": same,
        "rows": {
            "sampled": sampled_rows,
            "beyond_256": counts.beyond_first,
            "beyond_4096": counts.beyond_second,
        },
    }
    ratio = result["tpot_p50_ms"]["sort-after-256"] / result["tpot_p50_ms"]["tiers"]
    result["tiers_speedup"] = round(ratio, 3)
    return result


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
        "tiers": list(sampler_module._NUCLEUS_TIERS),
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
