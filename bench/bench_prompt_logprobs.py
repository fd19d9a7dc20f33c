"""What prompt logprobs cost a prompt on the CPU, against the same prompt without them.

One engine (the default model in its serving dtype, ``--threads`` cores, prefix caching off so
that every variant computes the whole prompt) computes prompts of ``--lengths`` tokens with
``max_tokens=1``, three variants alternating round by round in the same process:

- ``plain``: the prompt alone (its last row's logits only);
- ``prompt_logprobs=1``: every row's logits and the prompt tokens' logprobs with one
  alternative (what lm-evaluation-harness's loglikelihood asks for, as ``echo`` with
  ``logprobs: 1``);
- ``prompt_logprobs=20``: twenty alternatives a token (the most one may ask).

Per length and variant: the median over rounds of one prompt's seconds (``--batch`` prompts
at once, divided), the ratio to ``plain`` of the same rounds, and the share of the machine's
compute bound it reaches: the FLOPs the variant needs (``2 x tokens x layer_params`` for the
decoder, ``2 x head_params`` for each row whose logits it computes) at the matmul rate
``machine_bound.measure`` measures in the same run. The LM head's share of the FLOPs is what
computing every row's logits must cost at least.

    .venv/bin/python bench/bench_prompt_logprobs.py --lengths 256,1024 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from machine_bound import default_model_figures, measure
from splitserve_runner import alternated_rounds, write_report

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
VARIANTS: dict[str, int | None] = {
    "plain": None,
    "prompt_logprobs=1": 1,
    "prompt_logprobs=20": 20,
}
_TEXT = (
    "The lighthouse keeper climbed the spiral stairs each evening, counting the steps as his "
    "father had taught him. Below, the harbour emptied of boats, and the gulls settled on the "
    "breakwater. He trimmed the wick, polished the great lens, and watched the beam sweep over "
    "the dark water, marking the rocks that had claimed so many ships before the light was built. "
)


def prompts_of(core: EngineCore, length: int, count: int) -> list[list[int]]:
    """``count`` different prompts of exactly ``length`` tokens."""
    base = core.tokenizer.encode(_TEXT * (length // 40 + 2))
    return [[*core.tokenizer.encode(f"Part {i}."), *base][:length] for i in range(count)]


def seconds_per_prompt(
    core: EngineCore, prompts: list[list[int]], asked: int | None, tag: str
) -> float:
    """One burst of ``prompts`` with ``max_tokens=1``; its seconds over its prompts. Checks
    every request got one record per prompt token after the first when asked."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=asked)
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        core.add_request(f"{tag}-{index}", prompt, params)
    records: dict[str, int] = {}
    while core.has_unfinished:
        for output in core.step():
            records[output.update.request_id] = len(output.prompt_logprobs)
    elapsed = time.perf_counter() - started
    wanted = 0 if asked is None else len(prompts[0]) - 1
    if sorted(records.values()) != [wanted] * len(prompts):
        raise AssertionError(f"{tag}: prompt logprob records {records}")
    return elapsed / len(prompts)


def measure_length(core: EngineCore, length: int, batch: int, rounds: int, flops: Json) -> Json:
    prompts = prompts_of(core, length, batch)
    seconds_per_prompt(core, prompts, 1, f"warm-{length}")
    runs = alternated_rounds(
        tuple(VARIANTS),
        rounds,
        lambda name, index: seconds_per_prompt(
            core, prompts, VARIANTS[name], f"{name}-{length}-{index}"
        ),
    )
    medians = {name: statistics.median(values) for name, values in runs.items()}
    layer, head = flops["layer_params"], flops["head_params"]
    needed = {
        name: 2 * length * layer + 2 * head * (1 if asked is None else length)
        for name, asked in VARIANTS.items()
    }
    rate = flops["matmul_flop_per_s"]
    return {
        "prompt_tokens": length,
        "batch": batch,
        "ms_per_prompt": {name: round(value * 1e3, 2) for name, value in medians.items()},
        "ratio_to_plain": {
            name: round(value / medians["plain"], 3) for name, value in medians.items()
        },
        "flop_ratio_to_plain": {
            name: round(value / needed["plain"], 3) for name, value in needed.items()
        },
        "bound_fraction": {
            name: round(needed[name] / rate / medians[name], 3) for name in VARIANTS
        },
        "runs_ms": {name: [round(v * 1e3, 2) for v in values] for name, values in runs.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="256,1024", help="comma-separated prompt lengths")
    parser.add_argument("--batch", type=int, default=4, help="prompts computed together")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    machine = measure()
    core = EngineCore(
        EngineConfig(
            model=ModelConfig(model="default", dtype="auto"),
            runner=RunnerConfig(num_threads=args.threads),
            cache=CacheConfig(num_blocks=2048, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64),
        )
    )
    model = default_model_figures()
    flops = {
        "layer_params": model.layer_params,
        "head_params": model.head_params,
        "matmul_flop_per_s": machine.matmul_tflops * 1e12,
    }
    report: Json = {
        "machine": asdict(machine),
        "engine": {"threads": args.threads, "dtype": str(core.dtype).removeprefix("torch.")},
        "model": {"layer_params": model.layer_params, "head_params": model.head_params},
        "lengths": [],
    }
    for length in (int(value) for value in args.lengths.split(",")):
        row = measure_length(core, length, args.batch, args.rounds, flops)
        print(json.dumps(row), flush=True)
        report["lengths"].append(row)
    write_report(report, args.out, "prompt-logprobs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
