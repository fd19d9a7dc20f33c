"""Structural tags' cost against a plain JSON schema's, same run, same tokenizer: compile time
(cold: a spec not seen before; cached) and the mask's cost per output token along a valid
output, for each constraint.

The constraints: a JSON schema (the baseline, as ``bench_structured.py``'s mask), and
structural tags of the shapes users send: a reasoning region then a tagged JSON answer
(``sequence`` of ``tag(any_text)`` and ``tag(json_schema)``), tool calls inside free text
(``triggered_tags``, its free text excluding its triggers), the same with an ``excludes``
list, and a forced Hermes-style call (``tags_with_separator``, what
``--tool-call-parser hermes`` sends for ``tool_choice: required``). Each valid output is fed
token by token to ``GrammarMatchers.allowed`` (the engine's mask: llguidance's, into a torch
bool row), timed per token; median and p99 over the tokens of ``--reps`` passes. Prints rows
to stderr and the JSON report to stdout (``--out`` writes it too). Nothing asserted.

    .venv/bin/python bench/bench_structural_tags.py --out bench/results/structural-tags-<date>.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from machine_bound import cpu_name
from timing_stats import Json, emit_report, log_row, wait_for_quiet

from splitserve.common.grammar import GrammarCompiler, GrammarSpec
from splitserve.common.model_files import default_model_path
from splitserve.engine.checkpoint import load_checkpoint
from splitserve.engine.grammar_matchers import GrammarMatchers

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
CALL = '{"city": "San Francisco", "days": 3}'
PROSE = (
    "Let me think about which tool fits. The user asks about the weather, so the weather "
    "tool is the one to call, with the city and the number of days they gave. "
)
TOOLS = {
    "type": "triggered_tags",
    "triggers": ["<function="],
    "tags": [
        {"type": "tag", "begin": f"<function={name}>",
         "content": {"type": "json_schema", "json_schema": CITY}, "end": "</function>"}
        for name in ("get_weather", "get_forecast", "get_alerts")
    ],
}  # fmt: skip
CASES: dict[str, tuple[dict[str, Any] | None, str]] = {
    "json_schema": (None, CALL),
    "think_then_answer": (
        {"type": "sequence", "elements": [
            {"type": "tag", "begin": "<think>", "content": {"type": "any_text"},
             "end": "</think>"},
            {"type": "tag", "begin": "<answer>",
             "content": {"type": "json_schema", "json_schema": CITY}, "end": "</answer>"},
        ]},
        f"<think>{PROSE}</think><answer>{CALL}</answer>",
    ),
    "triggered_tags": (TOOLS, f"{PROSE}<function=get_weather>{CALL}</function> Done."),
    "triggered_tags_excludes": (
        {**TOOLS, "excludes": ["<|im_end|>", "<script>", "```"]},
        f"{PROSE}<function=get_weather>{CALL}</function> Done.",
    ),
    "hermes_forced": (
        {"type": "tags_with_separator", "separator": "\n", "at_least_one": True,
         "stop_after_first": True,
         "tags": [{"type": "tag", "begin": "<tool_call>\n",
                   "content": {"type": "json_schema", "json_schema": {
                       "type": "object",
                       "properties": {"name": {"const": "get_weather"}, "arguments": CITY},
                       "required": ["name", "arguments"], "additionalProperties": False}},
                   "end": "\n</tool_call>"}]},
        f'<tool_call>\n{{"name": "get_weather", "arguments": {CALL}}}\n</tool_call>',
    ),
}  # fmt: skip


def spec_of(fmt: dict[str, Any] | None) -> GrammarSpec:
    """The case's constraint (None: the baseline JSON schema)."""
    return (
        GrammarSpec.json_schema(CITY)
        if fmt is None
        else GrammarSpec.structural_tag({"format": fmt})
    )


def measure(compiler: GrammarCompiler, vocab: int, eos: set[int], tokenizer: Any, name: str,
            fmt: dict[str, Any] | None, text: str, reps: int) -> Json:  # fmt: skip
    cold, cached = [], []
    spec = spec_of(fmt)
    for _ in range(reps):
        compiler.compile.cache_clear()  # cold: llguidance's parse and checks again
        started = time.perf_counter()
        compiler.compile(spec)
        cold.append(time.perf_counter() - started)
        started = time.perf_counter()
        compiler.compile(spec)
        cached.append(time.perf_counter() - started)
    ids = tokenizer.encode(text, add_special_tokens=False)
    per_token = []
    for rep in range(reps):
        matchers = GrammarMatchers(compiler, vocab)
        request = f"{name}-{rep}"
        matchers.allowed(request, spec, [], eos)  # the matcher made, the first mask
        for k in range(1, len(ids) + 1):
            started = time.perf_counter()
            mask = matchers.allowed(request, spec, ids[:k], eos)
            per_token.append(time.perf_counter() - started)
            if k < len(ids):
                assert mask[ids[k]], f"{name}: token {k} of the valid output is masked"
        matchers.free(request)
    per_token.sort()
    return {
        "constraint": name,
        "compile_cold_ms": round(statistics.median(cold) * 1e3, 2),
        "compile_cached_us": round(statistics.median(cached) * 1e6, 1),
        "tokens": len(ids),
        "mask_us_p50": round(statistics.median(per_token) * 1e6, 1),
        "mask_us_p99": round(per_token[int(0.99 * (len(per_token) - 1))] * 1e6, 1),
    }


def run(args: argparse.Namespace) -> Json:
    import torch

    torch.set_num_threads(1)
    checkpoint = load_checkpoint(default_model_path(), torch.float32)
    config = checkpoint.config
    compiler = GrammarCompiler(
        checkpoint.tokenizer, config.vocab_size, sorted(config.eos_token_ids)
    )
    started = time.perf_counter()
    compiler.tokenizer  # noqa: B018 - built once, timed apart
    report: Json = {
        "cpu": cpu_name(),
        "setup": {"reps": args.reps, "model": "default (SmolLM2-135M-Instruct's tokenizer)",
                  "tokenizer_build_s": round(time.perf_counter() - started, 3)},
        "results": [],
    }  # fmt: skip
    wait_for_quiet(args.wait_quiet_s)
    for name, (fmt, text) in CASES.items():
        row = measure(compiler, config.vocab_size, set(config.eos_token_ids),
                      checkpoint.tokenizer, name, fmt, text, args.reps)  # fmt: skip
        log_row(row)
        report["results"].append(row)
    baseline = report["results"][0]["mask_us_p50"]
    for row in report["results"]:
        row["mask_p50_vs_json_schema"] = round(row["mask_us_p50"] / baseline, 2)
    return report


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--wait-quiet-s", type=float, default=20.0)
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    emit_report(run(args), args.out)


if __name__ == "__main__":
    main()
