"""Where one engine's time goes: every ``EngineCore.step()`` of a burst, timed, split into
prefill and decode steps, with the model's forward pass and its attention calls timed inside.

One burst of N requests (random prompts, greedy, ``ignore_eos``) is stepped to the end after a
small warm-up burst. A step counts as prefill when its forward pass ran more tokens than it
sampled (some were prompt tokens), else as decode. Prints one JSON document: the total
wall time and output tokens/s, and per kind of step the count and the median wall, forward and
attention milliseconds. ``--threads 1 --requests 32`` is one decode worker's share of the
``bench_vs_peers`` workload in its best configuration (two decode workers, a core each); run two
copies under ``taskset -c 0`` and ``taskset -c 1`` to see both workers' engines together.
Nothing is asserted: the bench only measures.

Usage: ``python bench/bench_step_times.py [--threads 1] [--requests 32]``
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from splitserve_runner import build_engine

from splitserve.common.sampling_params import SamplingParams


class _Stopwatch:
    """Seconds spent inside wrapped callables since the last ``take()``."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def _instrument(core: Any) -> tuple[_Stopwatch, _Stopwatch, dict[str, bool]]:
    """Time the model's forward pass and its attention backend's calls (wrapped in place);
    the dict's "prefill" says whether the last forward pass ran any prompt token."""
    forward_watch, attention_watch = _Stopwatch(), _Stopwatch()
    last = {"prefill": False}
    backend = core.runner.backend  # the backend every forward pass is given
    backend.forward = attention_watch.wrap(backend.forward)
    model = core.runner.model
    forward = model.forward

    def forward_noting_prefill(*args: Any, **kwargs: Any) -> Any:
        input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        logits_indices = kwargs["logits_indices"] if "logits_indices" in kwargs else args[5]
        last["prefill"] = input_ids.shape[0] > logits_indices.shape[0]
        return forward(*args, **kwargs)

    model.forward = forward_watch.wrap(forward_noting_prefill)
    return forward_watch, attention_watch, last


def _prompts(rng: random.Random, count: int, length: int) -> list[list[int]]:
    return [[rng.randrange(1000, 40000) for _ in range(length)] for _ in range(count)]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)

    core = build_engine(args.threads, args.kv_cache_gib)
    forward_watch, attention_watch, last = _instrument(core)
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for index, prompt in enumerate(_prompts(rng, 4, args.input_len)):  # warm-up
        core.add_request(f"warmup-{index}", prompt, params)
    while core.has_unfinished:
        core.step()
    forward_watch.take(), attention_watch.take()

    for index, prompt in enumerate(_prompts(rng, args.requests, args.input_len)):
        core.add_request(f"request-{index}", prompt, params)
    steps: dict[str, list[tuple[float, float, float]]] = {"prefill": [], "decode": []}
    start = time.perf_counter()
    while core.has_unfinished:
        step_start = time.perf_counter()
        core.step()
        wall = time.perf_counter() - step_start
        kind = "prefill" if last["prefill"] else "decode"
        steps[kind].append((wall, forward_watch.take(), attention_watch.take()))
    total = time.perf_counter() - start

    def summary(rows: list[tuple[float, float, float]]) -> dict[str, float]:
        if not rows:
            return {"steps": 0}
        columns = list(zip(*rows, strict=True))
        names = ("wall_ms", "forward_ms", "attention_ms")
        medians = {
            name: round(statistics.median(column) * 1e3, 2)
            for name, column in zip(names, columns, strict=True)
        }
        return {"steps": len(rows), **medians, "wall_s_total": round(sum(columns[0]), 3)}

    report = {
        "threads": args.threads,
        "requests": args.requests,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "total_s": round(total, 3),
        "output_tok_s": round(args.requests * args.output_len / total, 1),
        "prefill_steps": summary(steps["prefill"]),
        "decode_steps": summary(steps["decode"]),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
