"""``python -m splitserve.engine.sim_calibrate --out PROFILE``: fit a simulated engine's step
times to this machine's real engine.

It builds the real engine from the worker's engine flags (``--model``, ``--dtype``,
``--quantized-weights``, ``--max-num-batched-tokens`` ...), on ``--threads`` threads (default
1) pinned to as many cores (``--cpu-affinity``, default the first allowed: one core per
worker, as ``splitserve up`` pins them), and runs it through phases of load a serving worker
sees: a prefill worker's prompt-only steps, and decode batches of 1 to 32 requests refilled
in bursts (so steps with prompt chunks alternate with decode-only ones). Every step's shape
(``SchedulerOutput.shape``) and wall time is recorded after a warm-up; the step-cost model
(``common/step_cost.py``) is fitted to all of them and its error measured on steps it was not
fitted on (even steps fit, odd steps judge: ``sim_profile.held_out_mape``). It prints the
fit and the error and writes the profile (``engine/sim_profile.py``) that ``--engine sim
--sim-profile PROFILE`` reads.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from splitserve.common.cpu_affinity import parse_cpu_list
from splitserve.common.cpu_info import cpu_name
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.cli_args import add_engine_args, engine_config_from_args
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.sim_profile import (
    SimProfile,
    StepRecord,
    fit_step_cost,
    held_out_mape,
    read_step_logs,
    step_ratio_quantiles,
)

WARMUP_STEPS = 10
"""Steps left out of the fit: the first steps of each shape build oneDNN's primitives."""


@dataclass(frozen=True)
class LoadPhase:
    """A stretch of steps with one kind of load."""

    steps: int
    concurrency: int
    """Requests kept in the engine: refilled to this whenever they fall below half of it."""
    prompt_only: bool
    """Requests of one output token: a prefill worker's steps."""


PHASES = (
    LoadPhase(40, 8, True),
    LoadPhase(60, 1, False),
    LoadPhase(80, 8, False),
    LoadPhase(40, 4, True),
    LoadPhase(100, 16, False),
    LoadPhase(100, 32, False),
    LoadPhase(60, 4, False),
    LoadPhase(60, 24, False),
    LoadPhase(40, 12, True),
    LoadPhase(60, 2, False),
)


def record_steps(
    core: EngineCore, phases: Sequence[LoadPhase], seed: int, max_prompt_tokens: int = 768
) -> list[StepRecord]:
    """Run ``phases`` on ``core`` with random prompts (no shared prefixes) and return every
    step after the first ``WARMUP_STEPS``."""
    rng = random.Random(seed)
    vocab = core.model_config.vocab_size
    records: list[StepRecord] = []
    step_index = 0
    for phase_index, phase in enumerate(phases):
        for _ in range(phase.steps):
            running = len(core.scheduler.requests)
            if running < max(1, phase.concurrency // 2):
                for number in range(phase.concurrency - running):
                    length = rng.randint(16, max_prompt_tokens)
                    prompt = [rng.randrange(100, vocab - 100) for _ in range(length)]
                    max_tokens = 1 if phase.prompt_only else rng.randint(16, 128)
                    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
                    core.add_request(f"cal-{phase_index}-{step_index}-{number}", prompt, params)
            core.step()
            step_index += 1
            if step_index > WARMUP_STEPS and core.last_step.seconds > 0:
                records.append(StepRecord(core.last_step.shape, core.last_step.seconds))
        while core.has_unfinished:  # each phase starts from an empty engine
            core.step()
    return records


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m splitserve.engine.sim_calibrate", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="profile JSON to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--from-steps",
        type=Path,
        default=None,
        help="fit to the step logs (*.jsonl) in this directory instead of running an engine",
    )
    parser.add_argument(
        "--cpu-affinity",
        default=None,
        help="cores to pin to (default: the first --threads cores this process may use)",
    )
    add_engine_args(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    args = build_parser().parse_args(argv)
    if args.from_steps is not None:
        logs = sorted(args.from_steps.glob("*.jsonl"))
        if not logs:
            print(f"no step logs (*.jsonl) in {args.from_steps}", file=sys.stderr)
            return 2
        header = json.loads(logs[0].read_text(encoding="utf-8").split("\n", 1)[0])
        records = read_step_logs(logs)
        where = f"{len(logs)} step logs in {args.from_steps}"
        return _write(args.out, records, where, header)
    args.threads = args.threads or 1
    allowed = sorted(os.sched_getaffinity(0))
    cores = parse_cpu_list(args.cpu_affinity) if args.cpu_affinity else set(allowed[: args.threads])
    os.sched_setaffinity(0, cores)
    config = engine_config_from_args(args)
    if config.runner.engine != "model":
        print("calibrate against the real engine (--engine model)", file=sys.stderr)
        return 2
    core = EngineCore(config)
    records = record_steps(core, PHASES, args.seed)
    header = {
        "model": core.model_config.name,
        "cpu": cpu_name(),
        "threads": args.threads,
        "dtype": str(core.dtype).removeprefix("torch."),
        "kv_bytes_per_token": core.model_config.kv_bytes_per_token(core.dtype.itemsize),
    }
    return _write(args.out, records, f"cores {sorted(cores)}", header)


def _write(out: Path, records: Sequence[StepRecord], where: str, header: dict[str, object]) -> int:
    """Fit ``records``, print the fit and its held-out error, write the profile."""
    error = held_out_mape(records)
    cost = fit_step_cost(records)
    profile = SimProfile(
        step_cost=cost,
        model_name=str(header["model"]),
        cpu=str(header["cpu"]),
        threads=int(str(header["threads"])),
        dtype=str(header["dtype"]),
        steps=len(records),
        mape=round(error, 4),
        kv_bytes_per_token=int(str(header.get("kv_bytes_per_token", 0))),
        step_ratio_quantiles=step_ratio_quantiles(cost, records),
        prefill_ratio_quantiles=step_ratio_quantiles(cost, records, computes_prompt=True),
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(profile.to_json(), encoding="utf-8")
    print(
        f"{len(records)} steps ({where}; {profile.cpu}, {profile.dtype}, {profile.threads} "
        f"thread{'s' if profile.threads > 1 else ''}): decode "
        f"{cost.decode_base_s * 1e3:.2f} ms + {cost.per_decode_seq_s * 1e3:.3f} ms/request + "
        f"{cost.per_context_token_s * 1e6:.3f} us/context token; prefill "
        f"{cost.prefill_base_s * 1e3:.2f} ms + {cost.per_prefill_token_s * 1e6:.1f} us/token; "
        f"held-out MAPE {error:.1%}; wrote {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
