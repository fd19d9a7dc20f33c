"""What LoRA adapters cost a decode step on the CPU, against the base model in the same run.

One engine (the default model, the serving dtype, one core unless ``--threads``) loads
``--loaded`` adapters (four unless told) of rank ``--rank`` on all seven projections,
written in PEFT's saved format with random factors (what a step costs does not depend on the
factors' values). Bursts of the same chat requests, greedy, ``--tokens`` tokens each,
alternate round by round between:

- ``base``: no request names an adapter (the C decode loop where it applies);
- ``base_python``: the same with the C decode loop off, the Python layer loop that every
  step with an adapter's rows runs (what of an adapter's cost is the loop's);
- ``one``: every request names adapter 0;
- ``half``: every other request names adapter 0, the rest the base model;
- ``four``: requests spread over the four adapters.

Per variant (``--variants`` picks some; ``base`` always runs): the median over rounds of
the burst's TPOT p50 and its ratio to ``base``. ``--loaded 16`` with ``--variants one`` says
what the adapters loaded but not in the step cost a step (the bank multiplies by them all).

``--max-loras 0,2,4`` instead compares bounds on the adapters among the running requests
(``SchedulerConfig.max_loras``, vLLM's ``--max-loras``; 0: none) on one burst whose requests
spread over ``--spread`` adapters (8 unless told; ``--loaded`` at least that), alternated
round by round: per bound, the medians of output tokens/s, TPOT p50 and p99 and TTFT p50
and p99, and their ratios to no bound. A bound makes each step pay for fewer adapters and
makes the requests of the others wait.
Nothing is asserted: the bench only measures.

    .venv/bin/python bench/bench_lora.py --batches 8,32 --rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from bench_sampling import chat_prompts
from safetensors.torch import save_file
from splitserve_runner import alternated_rounds, timed_burst, write_report
from timing_stats import run_metrics

from splitserve.common.cpu_info import cpu_name
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine import lora
from splitserve.engine.checkpoint import describe_checkpoint
from splitserve.engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    RunnerConfig,
    SchedulerConfig,
)
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.model_config import ModelArchConfig

Json = dict[str, Any]
VARIANTS = ("base", "base_python", "one", "half", "four")
ADAPTERS = 4
TARGETS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def _shapes(config: ModelArchConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each target projection."""
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (config.q_size, hidden),
        "k_proj": (config.kv_size, hidden),
        "v_proj": (config.kv_size, hidden),
        "o_proj": (hidden, config.q_size),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def write_adapter(folder: Path, config: ModelArchConfig, rank: int, seed: int) -> None:
    """A rank-``rank`` adapter on every projection, in PEFT's saved format."""
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, targets in TARGETS.items():
            for target in targets:
                out, inp = _shapes(config)[target]
                key = f"base_model.model.model.layers.{layer}.{module}.{target}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=generator)
                tensors[f"{key}.lora_B.weight"] = 0.01 * torch.randn(out, rank, generator=generator)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    settings = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": [t for targets in TARGETS.values() for t in targets],
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(settings))


def _adapters_of(variant: str, batch: int) -> list[str]:
    """Each request's adapter name ("" for the base model) in ``variant``."""
    if variant in ("base", "base_python"):
        return [""] * batch
    if variant == "one":
        return ["a0"] * batch
    if variant == "half":
        return ["a0" if i % 2 == 0 else "" for i in range(batch)]
    return [f"a{i % ADAPTERS}" for i in range(batch)]


def one_burst(
    core: EngineCore, prompts: list[list[int]], variant: str, tokens: int, tag: str
) -> float:
    """TPOT p50 (ms) of one burst of ``variant``."""
    params = [
        SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0, adapter=name)
        for name in _adapters_of(variant, len(prompts))
    ]
    model = core.runner.model
    loop = model._decode_layers
    if variant == "base_python":
        model._decode_layers = None
    try:
        burst = timed_burst(core, prompts, params, tag)
    finally:
        model._decode_layers = loop
    return run_metrics(burst.requests, burst.start, burst.end, burst.cpu_seconds).tpot_p50_ms


def measure(
    core: EngineCore, batch: int, rounds: int, tokens: int, variants: tuple[str, ...]
) -> Json:
    prompts = chat_prompts(core, batch)
    for variant in variants:
        one_burst(core, prompts, variant, 4, f"warm-{variant}-{batch}")
    tpot = alternated_rounds(
        variants,
        rounds,
        lambda variant, index: one_burst(
            core, prompts, variant, tokens, f"{variant}-{batch}-{index}"
        ),
    )
    p50 = {name: round(statistics.median(v), 2) for name, v in tpot.items()}
    return {
        "batch": batch,
        "tpot_p50_ms": p50,
        "ratio_to_base": {name: round(p50[name] / p50["base"], 3) for name in variants},
        "tpot_runs_ms": {name: [round(x, 2) for x in v] for name, v in tpot.items()},
    }


def measure_max_loras(
    core: EngineCore, batch: int, rounds: int, tokens: int, bounds: list[int], spread: int
) -> Json:
    """One burst of ``batch`` requests over ``spread`` adapters under each bound on the
    running requests' adapters, alternated round by round (module docstring)."""
    prompts = chat_prompts(core, batch)
    params = [
        SamplingParams(
            max_tokens=tokens, ignore_eos=True, temperature=0.0, adapter=f"a{i % spread}"
        )
        for i in range(batch)
    ]
    config = core.scheduler.config

    def burst(bound: str, index: int) -> Json:
        core.scheduler.config = dataclasses.replace(config, max_loras=int(bound))
        try:
            timed = timed_burst(core, prompts, params, f"bound{bound}-{batch}-{index}")
        finally:
            core.scheduler.config = config
        return asdict(run_metrics(timed.requests, timed.start, timed.end, timed.cpu_seconds))

    names = [str(bound) for bound in bounds]
    burst(names[0], -1)  # warm-up
    runs = alternated_rounds(names, rounds, burst)
    fields = ("output_tokens_per_s", "tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms", "ttft_p99_ms")
    medians = {
        name: {f: round(statistics.median(r[f] for r in rows), 2) for f in fields}
        for name, rows in runs.items()
    }
    base = medians.get("0", medians[names[0]])
    return {
        "batch": batch,
        "spread": spread,
        "medians_by_max_loras": medians,
        "ratio_to_unbounded": {
            name: {f: round(m[f] / base[f], 3) for f in fields} for name, m in medians.items()
        },
        "runs": runs,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="8,32", help="comma-separated batch sizes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48, help="tokens per request")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--loaded", type=int, default=ADAPTERS, help="adapters loaded (>= 4)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {VARIANTS}")
    parser.add_argument(
        "--bank-max",
        type=int,
        default=lora.BANK_MAX_ADAPTERS,
        help="the most adapters laid side by side (engine/lora.py:BANK_MAX_ADAPTERS); more "
        "loaded: each apart. 0: always apart",
    )
    parser.add_argument(
        "--max-loras",
        default="",
        help="comma-separated bounds on the running requests' adapters (0: none) to compare "
        "on a burst spread over --spread adapters, instead of the variants",
    )
    parser.add_argument("--spread", type=int, default=8, help="adapters of a --max-loras burst")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    lora.BANK_MAX_ADAPTERS = args.bank_max
    if args.max_loras and args.loaded < args.spread:
        parser.error("--loaded must be at least --spread")
    variants = tuple(dict.fromkeys(("base", *args.variants.split(","))))
    if args.loaded < ADAPTERS or not set(variants) <= set(VARIANTS):
        parser.error(f"--loaded must be at least {ADAPTERS}; variants are {VARIANTS}")
    config = describe_checkpoint("default").config
    with tempfile.TemporaryDirectory() as folder:
        modules = []
        for index in range(args.loaded):
            path = Path(folder) / f"a{index}"
            write_adapter(path, config, args.rank, seed=index)
            modules.append((f"a{index}", str(path)))
        core = EngineCore(
            EngineConfig(
                model=ModelConfig(
                    model="default",
                    dtype="auto",
                    lora_modules=tuple(modules),
                    max_lora_adapters=args.loaded,
                ),
                runner=RunnerConfig(num_threads=args.threads),
                cache=CacheConfig(num_blocks=2048),
                scheduler=SchedulerConfig(max_num_seqs=256),
            )
        )
    report: Json = {
        "cpu": cpu_name(),
        "c_decode_loop": core.runner.model._decode_layers is not None,
        "threads": args.threads,
        "dtype": str(core.dtype),
        "rank": args.rank,
        "adapters": args.loaded,
        "layout": type(core.runner.model.adapters).__name__,
        "tokens": args.tokens,
        "batches": [],
    }
    bounds = [int(b) for b in args.max_loras.split(",")] if args.max_loras else []
    for batch in (int(b) for b in args.batches.split(",")):
        if bounds:
            row = measure_max_loras(core, batch, args.rounds, args.tokens, bounds, args.spread)
            print(json.dumps({k: v for k, v in row.items() if k != "runs"}), flush=True)
        else:
            row = measure(core, batch, args.rounds, args.tokens, variants)
            print(json.dumps(row), flush=True)
        report["batches"].append(row)
    write_report(report, args.out, "lora-max-loras" if bounds else "lora")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
