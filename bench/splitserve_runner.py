"""splitserve's side of the bench: one burst of requests through an ``EngineCore``.

Every prompt is submitted at once and the core is driven by ``step()`` until all finish; each
token is stamped with ``time.perf_counter()`` when the step that produced it returns, and TTFT,
TPOT and throughput come from ``timing_stats.run_metrics``. Each burst also checks that every
KV block came back to the pool, counts prefix-cache hit tokens and requests whose output length
is wrong; ``num_preemptions`` reads the scheduler's preemption count.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any, TypeVar

from timing_stats import RequestTiming, RunResult, run_metrics

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    RunnerConfig,
    SchedulerConfig,
)
from splitserve.engine.engine_core import EngineCore

T = TypeVar("T")
RESULTS = Path(__file__).resolve().parent / "results"


def alternated_rounds(
    variants: Sequence[str], rounds: int, run: Callable[[str, int], T]
) -> dict[str, list[T]]:
    """Each variant's ``run(variant, round_index)`` over ``rounds`` rounds, in order: the
    variants run in their order in even rounds and in reverse in odd ones, so that none
    always runs right after the same other one (a shared machine's drift falls on all)."""
    results: dict[str, list[T]] = {variant: [] for variant in variants}
    for round_index in range(rounds):
        order = variants if round_index % 2 == 0 else tuple(reversed(variants))
        for variant in order:
            results[variant].append(run(variant, round_index))
    return results


def write_report(report: dict[str, Any], out: Path | None, name: str) -> Path:
    """``report`` as indented JSON in ``out``, by default ``results/<name>-<today>.json``;
    says where."""
    path = out or RESULTS / f"{name}-{date.today().isoformat()}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def build_engine(threads: int, kv_cache_gib: float) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=ModelConfig(model="default", dtype="auto"),
            runner=RunnerConfig(num_threads=threads),
            cache=CacheConfig(kv_cache_gib=kv_cache_gib),
            scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256),
        )
    )


@dataclass
class TimedBurst:
    """One burst's timings (in prompt order), its span and its process CPU time."""

    requests: list[RequestTiming]
    start: float
    end: float
    cpu_seconds: float
    cached_tokens: int
    """Prompt tokens the prefix cache served."""


def timed_burst(
    core: EngineCore,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    tag: str,
) -> TimedBurst:
    """Submit every prompt at once (ids ``<tag>-<index>``) and step until all finish, each
    token stamped when the step that produced it returns; ``params`` for all, or each
    prompt's."""
    each = params if isinstance(params, list) else [params] * len(prompts)
    timings: dict[str, RequestTiming] = {}
    cached_tokens = 0
    cpu_start, start = time.process_time(), time.perf_counter()
    for index, prompt in enumerate(prompts):
        timings[f"{tag}-{index}"] = RequestTiming(submit_time=time.perf_counter())
        core.add_request(f"{tag}-{index}", prompt, each[index])
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
    return TimedBurst(list(timings.values()), start, end, cpu_seconds, cached_tokens)


def run_burst(core: EngineCore, prompts: list[list[int]], max_tokens: int, tag: str) -> RunResult:
    """Submit every prompt at once, step until all finish, then check the KV pool is whole."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    burst = timed_burst(core, prompts, params, tag)
    requests, start, end, cpu_seconds = burst.requests, burst.start, burst.end, burst.cpu_seconds
    cached_tokens = burst.cached_tokens
    checks = {
        "kv_blocks_freed": core.kv_cache.num_free_blocks == core.kv_cache.num_blocks,
        "prefix_cache_hit_tokens": cached_tokens,
        "requests_with_wrong_output_len": sum(len(t.token_ids) != max_tokens for t in requests),
    }
    return RunResult(run_metrics(requests, start, end, cpu_seconds), requests[0].token_ids, checks)


def num_preemptions(core: EngineCore) -> int:
    return getattr(getattr(core.scheduler, "stats", None), "num_preemptions", 0)
