"""Structured outputs: TPOT and output tokens/s with a JSON schema against free generation,
same run, same engine; grammar compile time cold and cached; the mask's cost per token.

One ``EngineCore`` over the default model (bf16 where the CPU has it, one torch thread: a
decode worker's core). The same chat prompts ("describe N people as JSON") are sent
``streams`` at a time (1 and 8), greedy, at most ``--max-tokens`` tokens, free and under a
JSON schema (an object holding an array of person objects), alternating, ``--reps`` times.
TPOT per request = (last token - first token) / (tokens - 1), median over requests, then over
repetitions (``timing_stats.run_metrics``). Compile: ``GrammarCompiler.compile`` of a fresh
schema (cold: llguidance's parse and checks; the tokenizer is built before) and of the same
again (cached). Mask: ``GrammarMatchers.allowed`` timed over the tokens of a valid output.
Prints rows to stderr and the JSON report to stdout (``--out`` writes it too). Nothing
asserted.

    .venv/bin/python bench/bench_structured.py --out bench/results/structured-<date>.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from machine_bound import cpu_name
from splitserve_runner import timed_burst
from timing_stats import Json, emit_report, log_row, run_metrics, wait_for_quiet

from splitserve.common.grammar import GrammarSpec
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.config import CacheConfig, EngineConfig, ModelConfig, RunnerConfig
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.grammar_matchers import GrammarMatchers

SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 20},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "city": {"type": "string", "maxLength": 20},
                },
                "required": ["name", "age", "city"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["people"],
    "additionalProperties": False,
}
TOPICS = ["a football team", "a school class", "a family", "a book club", "a band", "a crew",
          "a research group", "a village council"]  # fmt: skip


def build_engine() -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=ModelConfig(model="default", dtype="auto"),
            cache=CacheConfig(num_blocks=2048),
            runner=RunnerConfig(num_threads=1),
        )
    )


def run_once(core: EngineCore, prompts: list[list[int]], params: SamplingParams, tag: str) -> Json:
    burst = timed_burst(core, prompts, params, tag)
    metrics = run_metrics(burst.requests, burst.start, burst.end, burst.cpu_seconds)
    return {
        "tpot_p50_ms": metrics.tpot_p50_ms,
        "output_tokens_per_s": metrics.output_tokens_per_s,
        "tokens": [len(timing.token_ids) for timing in burst.requests],
        "texts": [core.tokenizer.decode(timing.token_ids) for timing in burst.requests],
    }


def compile_times(core: EngineCore, reps: int) -> Json:
    compiler = core.runner.grammars.compiler  # type: ignore[union-attr]
    started = time.perf_counter()
    compiler.tokenizer  # noqa: B018 - built once per engine, timed apart
    tokenizer_s = time.perf_counter() - started
    cold, cached = [], []
    for rep in range(reps):
        schema = {**SCHEMA, "title": f"people-{rep}"}  # a new spec each time: not in the cache
        spec = GrammarSpec.json_schema(schema)
        started = time.perf_counter()
        compiler.compile(spec)
        cold.append(time.perf_counter() - started)
        started = time.perf_counter()
        compiler.compile(spec)
        cached.append(time.perf_counter() - started)
    return {
        "tokenizer_build_s": round(tokenizer_s, 3),
        "compile_cold_ms": round(statistics.median(cold) * 1e3, 3),
        "compile_cached_us": round(statistics.median(cached) * 1e6, 2),
    }


def mask_cost(core: EngineCore, text: str) -> Json:
    matchers = GrammarMatchers(core.runner.grammars.compiler, core.model_config.vocab_size)  # type: ignore[union-attr]
    spec = GrammarSpec.json_schema(SCHEMA)
    ids = core.tokenizer.encode(text)
    matchers.allowed("probe", spec, [], core.eos_token_ids)  # the matcher's construction
    started = time.perf_counter()
    matchers.allowed("first", spec, [], core.eos_token_ids)
    construction_s = time.perf_counter() - started
    times = []
    for k in range(1, len(ids) + 1):
        started = time.perf_counter()
        matchers.allowed("first", spec, ids[:k], core.eos_token_ids)
        times.append(time.perf_counter() - started)
    return {
        "matcher_construction_ms": round(construction_s * 1e3, 2),
        "mask_per_token_us_p50": round(statistics.median(times) * 1e6, 1),
        "mask_per_token_us_max": round(max(times) * 1e6, 1),
        "tokens": len(ids),
    }


def run(args: argparse.Namespace) -> Json:
    core = build_engine()
    tokenizer = core.tokenizer
    prompts = [
        tokenizer.encode(tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Describe the members of {topic} as JSON."}]
        ))
        for topic in TOPICS
    ]  # fmt: skip
    report: Json = {
        "cpu": cpu_name(),
        "setup": {"dtype": str(core.dtype), "threads": 1, "max_tokens": args.max_tokens,
                  "reps": args.reps},
        "compile": compile_times(core, args.reps),
        "results": [],
    }  # fmt: skip
    log_row(report["compile"])
    kinds = {
        "free": SamplingParams(max_tokens=args.max_tokens, temperature=0.0),
        "json_schema": SamplingParams(
            max_tokens=args.max_tokens, temperature=0.0, grammar=GrammarSpec.json_schema(SCHEMA)
        ),
    }
    example = ""
    for streams in args.streams:
        runs: dict[str, list[Json]] = {kind: [] for kind in kinds}
        for rep in range(args.reps):
            for kind, params in kinds.items():
                wait_for_quiet(args.wait_quiet_s)
                result = run_once(core, prompts[:streams], params, f"{streams}-{rep}-{kind}")
                runs[kind].append(result)
                if kind == "json_schema":
                    example = result["texts"][0]
        row: Json = {"streams": streams}
        for kind, results in runs.items():
            row[f"{kind}_tpot_ms"] = round(statistics.median(r["tpot_p50_ms"] for r in results), 2)
            row[f"{kind}_tokens_per_s"] = round(
                statistics.median(r["output_tokens_per_s"] for r in results), 1
            )
            row[f"{kind}_tpot_per_rep"] = [round(r["tpot_p50_ms"], 2) for r in results]
            row[f"{kind}_tokens_per_request"] = statistics.median(
                n for r in results for n in r["tokens"]
            )
        row["json_outputs_parse"] = sum(
            _parses(text) for r in runs["json_schema"] for text in r["texts"]
        )
        row["json_outputs"] = sum(len(r["texts"]) for r in runs["json_schema"])
        log_row(row)
        report["results"].append(row)
    report["mask"] = mask_cost(core, example if _parses(example) else '{"people": []}')
    log_row(report["mask"])
    return report


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
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
