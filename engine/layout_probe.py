"""``python -m splitserve.engine.layout_probe --out PROBE [engine flags]``: what one engine of
this machine does on part of its cores and on all of them, for ``splitserve up --layout auto``.

It builds the real engine from the worker's engine flags (``--model``, ``--dtype``,
``--quantized-weights`` ...; other flags are ignored) and times, with each thread count of
``probe_thread_counts`` (the cores a worker of ``up``'s split layout gets, then all of them):

- one prompt of ``--prompt-tokens`` random tokens computed alone (the time of the step that
  computes it, prompt and first token; after a warm-up prompt);
- decode steps of 1 and of ``BATCH`` requests whose context is such a prompt (they share it
  through the prefix cache, so setting them up costs one token each): the median of
  ``DECODE_STEPS`` steps after ``WARMUP_DECODE_STEPS``.

The thread counts take turns: ``ROUNDS`` rounds, each measuring one prompt and both decode
batches on every thread count, so that a slow spell of a shared machine (its one-core speed
moved between two levels minutes apart, bench/log/2026-11.md) falls on both counts alike.
Measured one count after the other, a slow spell during the 1-thread half (a prompt at 1.76 s
where 0.83 s was usual) once made the split layout look unable to meet the TTFT target at any
rate, and ``auto`` started the layout that served less. Each time is the median over the rounds
of a prompt (fresh random tokens, no prefix hit) or of the median decode step of each round,
all measured beside a neighbour: a process, not pinned, that keeps ``NEIGHBOUR_DUTY`` of one
core busy in short bursts, ``1 / NEIGHBOUR_PERIOD_S`` a second, as the threads that relay a
served stream's tokens (the worker's own, the coordinator's, the gateway's) wake beside the
engine. A step on every core waits, at each of its parallel regions, for whichever of its
threads the OS set aside for them, while a step on one core loses only the time they take. On
the 2-core Cascade Lake Xeon of 2026-11-27, served at 0.6 req/s of the chat workload, the dual-
role engine's 2-thread decode step of one request took 39 ms and the split layout's 1-thread
one 30 ms; probed quietly, 2 threads measured 1.2-1.4x faster than 1, and beside 100-us bursts
at 1 kHz 1.2x slower (32 against 27 ms), as served. Bursts of 1 ms at 100 Hz did not show it. A
probe of a quiet machine would choose a layout for a machine ``up`` never runs on."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from splitserve.common.cpu_info import cpu_name
from splitserve.common.layout_probe import (
    BATCH,
    PhaseTimes,
    ProbeResult,
    probe_thread_counts,
)
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.cli_args import add_engine_args, engine_config_from_args
from splitserve.engine.engine_core import EngineCore

NEIGHBOUR_DUTY = 0.10
"""Share of one core the neighbour keeps busy: the coordinator and the gateway took 5-13% of
a core in the served runs of bench/log/2026-11.md ("Core lending")."""
NEIGHBOUR_PERIOD_S = 0.001
"""One burst a millisecond: a served stream's tokens wake several threads each."""
ROUNDS = 3
ALLOWED_CORES = frozenset(os.sched_getaffinity(0))
"""The cores this process may use at start, before ``measure`` narrows them."""
WARMUP_DECODE_STEPS = 4
DECODE_STEPS = 10


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m splitserve.engine.layout_probe", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="probe JSON to write")
    parser.add_argument("--prompt-tokens", type=int, default=320)
    parser.add_argument("--seed", type=int, default=0)
    add_engine_args(parser)
    return parser


def _prompt_s(core: EngineCore, prompt: list[int], name: str) -> float:
    """Seconds of the step that computes ``prompt`` alone (an otherwise empty engine)."""
    core.add_request(name, prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    seconds = 0.0
    while core.has_unfinished:
        core.step()
        seconds += core.last_step.seconds
    return seconds


def _decode_step_s(core: EngineCore, context: list[int], batch: int, name: str) -> float:
    """Median seconds of a decode-only step of ``batch`` requests over ``context``."""
    steps = WARMUP_DECODE_STEPS + DECODE_STEPS
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    for number in range(batch):  # distinct last tokens: the shared part is a prefix hit
        core.add_request(f"{name}-{number}", [*context, 100 + number], params)
    times: list[float] = []
    while core.has_unfinished:
        core.step()
        shape = core.last_step.shape
        if shape is not None and shape.prefill_tokens == 0 and shape.decode_seqs == batch:
            times.append(core.last_step.seconds)
    measured = times[WARMUP_DECODE_STEPS:] or times
    return statistics.median(measured)


def _on_threads(threads: int) -> None:
    """Run this process's steps on the first ``threads`` allowed cores."""
    os.sched_setaffinity(0, set(sorted(ALLOWED_CORES)[:threads]))
    torch.set_num_threads(threads)


def measure(
    core: EngineCore, counts: Sequence[int], prompt_tokens: int, seed: int
) -> tuple[PhaseTimes, ...]:
    """This engine's phase times on the first ``threads`` allowed cores, for each of
    ``counts``, the counts taking turns round by round (see the module docstring)."""
    rng = random.Random(seed)
    vocab = core.model_config.vocab_size

    def prompt() -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(prompt_tokens)]

    samples: dict[int, list[tuple[float, float, float]]] = {threads: [] for threads in counts}
    for threads in counts:  # warm each count's kernels and thread pool once
        _on_threads(threads)
        _prompt_s(core, prompt(), f"warm-{threads}")
    for round_number in range(ROUNDS):
        for threads in counts:
            _on_threads(threads)
            name = f"{threads}-{round_number}"
            context = prompt()
            prefill_s = _prompt_s(core, context, f"prompt-{name}")
            one = _decode_step_s(core, context, 1, f"one-{name}")
            many = _decode_step_s(core, context, BATCH, f"batch-{name}")
            samples[threads].append((prefill_s, one, many))
    return tuple(
        PhaseTimes(
            threads=threads,
            prefill_s=statistics.median(sample[0] for sample in samples[threads]),
            decode_one_s=statistics.median(sample[1] for sample in samples[threads]),
            decode_batch_s=statistics.median(sample[2] for sample in samples[threads]),
        )
        for threads in counts
    )


_NEIGHBOUR = """
import sys, time
busy_s, idle_s = float(sys.argv[1]), float(sys.argv[2])
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < busy_s:
        pass
    time.sleep(idle_s)
"""


@contextlib.contextmanager
def neighbour(duty: float = NEIGHBOUR_DUTY) -> Iterator[None]:
    """A process beside the probe keeping ``duty`` of one core busy (any allowed core), in
    bursts of ``duty * NEIGHBOUR_PERIOD_S``; killed on exit."""
    busy_s, idle_s = duty * NEIGHBOUR_PERIOD_S, (1 - duty) * NEIGHBOUR_PERIOD_S
    process = subprocess.Popen(
        [sys.executable, "-c", _NEIGHBOUR, str(busy_s), str(idle_s)],
        preexec_fn=lambda: os.sched_setaffinity(0, ALLOWED_CORES),
    )
    try:
        yield
    finally:
        process.kill()
        process.wait()


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    args, _ignored = build_parser().parse_known_args(argv)
    started = time.perf_counter()
    counts = probe_thread_counts(len(ALLOWED_CORES))
    args.threads = counts[0]  # measure() narrows the cores, fewest first
    config = engine_config_from_args(args)
    if config.runner.engine != "model":
        print("the layout probe measures the real engine (--engine model)", file=sys.stderr)
        return 2
    core = EngineCore(config)
    with neighbour():
        phases = measure(core, counts, args.prompt_tokens, args.seed)
    result = ProbeResult(
        cpu=cpu_name(),
        cores=len(ALLOWED_CORES),
        dtype=str(core.dtype).removeprefix("torch."),
        prompt_tokens=args.prompt_tokens,
        phases=phases,
        probe_s=round(time.perf_counter() - started, 1),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result.to_json(), indent=2), encoding="utf-8")
    print(result.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
