"""Detokenization cost per output token: ``tokenizers``' ``DecodeStream`` against our window.

Both rows run ``IncrementalDetokenizer`` on the default model's tokenizer (SmolLM2, byte-level
BPE, loaded from its GGUF), fed one token per ``add_tokens`` call as a decode worker feeds it:

- ``windowed``: the tokenizer behind an adapter that offers only ``decode``, so the detokenizer
  re-decodes its context window per call (the implementation before ``DecodeStream``).
- ``stream``: the tokenizer itself, so ``tokenizers.decoders.DecodeStream`` does the decoding.

A third row, ``DecodeStream alone``, is the library's own loop (``step`` per token, no stop
strings, no bookkeeping): the floor the ``stream`` row's Python around it adds to.

Outputs: English prose, Python code and multi-byte text (CJK, Greek, Hangul, emoji with ZWJ
sequences), each after a chat-template prompt, with no stop strings and with two that never
match (their hold-back scan runs every call). One repetition times every row on every output,
the rows interleaved so that they share the machine's noise; a row's figure is its total time
over its total tokens (detokenizer construction included: its prompt-context decode is paid
per request). The machine is shared: the bench reports medians over ``--reps`` repetitions and
the ratios of medians taken in this one run. Before timing it checks that both rows emit the
same deltas and that they concatenate to ``decode(output_ids)``; it exits non-zero if not.

Usage: ``python bench/bench_detokenizer.py [--reps 21] [--json out.json]``
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import tokenizers
from tokenizers.decoders import DecodeStream

from splitserve.common.detokenizer import CONTEXT_TOKENS, IncrementalDetokenizer, TokenDecoder
from splitserve.common.model_files import load_tokenizer
from splitserve.common.tokenizer import Tokenizer

PROSE = (
    "The committee met on Tuesday to review the proposal. After a long discussion about the "
    "budget, the schedule and the risks, most members agreed that the plan was sound, although "
    "several asked for a clearer account of how the costs would be shared between the two "
    "departments. The chair promised a revised draft by the end of the month.\n\n"
    "In the meantime, the working group will collect feedback from the people most affected: "
    "students, staff and the neighbours who live near the construction site. "
) * 3
CODE = (
    "def merge_sorted(left: list[int], right: list[int]) -> list[int]:\n"
    '    """Merge two sorted lists into one sorted list."""\n'
    "    merged, i, j = [], 0, 0\n"
    "    while i < len(left) and j < len(right):\n"
    "        if left[i] <= right[j]:\n"
    "            merged.append(left[i])\n"
    "            i += 1\n"
    "        else:\n"
    "            merged.append(right[j])\n"
    "            j += 1\n"
    "    return merged + left[i:] + right[j:]\n\n"
    "for value in merge_sorted([1, 4, 9], [2, 3, 10]):\n"
    "    print(f'{value:>4d} -> {value ** 2}')\n"
) * 3
MULTIBYTE = (
    "今日は天気がいいので、公園を散歩しました。桜の花がとてもきれいでした。"
    "我们明天在北京见面，然后一起去吃饭。 Ελληνικά κείμενα για δοκιμή. "
    "한국어 문장도 조금 넣어 봅니다. 😀🎉👍🏽 👩\u200d👩\u200d👧 café naïve Ünïcödé ✓ "
) * 4
OUTPUTS = {"prose": PROSE, "code": CODE, "multibyte": MULTIBYTE}
STOP_SETS: dict[str, tuple[str, ...]] = {"no stops": (), "2 stops": ("</answer>", "\n\n\n")}
PROMPT_MESSAGES = [{"role": "user", "content": "Please write the next part."}]


class DecodeOnly:
    """A ``TokenDecoder`` exposing only ``decode``: forces the detokenizer's windowed path."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def detokenize(
    decoder: TokenDecoder, prompt_ids: list[int], output_ids: list[int], stops: Sequence[str]
) -> list[str]:
    """The deltas ``IncrementalDetokenizer`` emits, one token per call, plus ``finish()``."""
    detok = IncrementalDetokenizer(decoder, prompt_ids, stops)
    deltas = [detok.add_tokens((token_id,)).text for token_id in output_ids]
    deltas.append(detok.finish())
    return deltas


def library_alone(
    backend: tokenizers.Tokenizer, prompt_ids: list[int], output_ids: list[int]
) -> list[str | None]:
    """``DecodeStream`` by itself, as its documentation loops it."""
    stream = DecodeStream(prompt_ids[-CONTEXT_TOKENS:], skip_special_tokens=True)
    return [stream.step(backend, token_id) for token_id in output_ids]


def check_equal(
    tokenizer: Tokenizer, prompt_ids: list[int], outputs: dict[str, list[int]]
) -> list[str]:
    """Both paths emit the same deltas, concatenating to ``decode``; returns the mismatches."""
    mismatches = []
    for name, output_ids in outputs.items():
        for stops in STOP_SETS.values():
            windowed = detokenize(DecodeOnly(tokenizer), prompt_ids, output_ids, stops)
            stream = detokenize(tokenizer, prompt_ids, output_ids, stops)
            if windowed != stream or "".join(stream) != tokenizer.decode(output_ids):
                mismatches.append(f"{name} stops={stops!r}")
    return mismatches


def time_rows(
    rows: dict[str, Callable[[list[int]], object]], outputs: dict[str, list[int]], reps: int
) -> dict[str, list[float]]:
    """Per row, the microseconds per token of each repetition (all outputs, rows interleaved)."""
    total_tokens = sum(len(ids) for ids in outputs.values())
    per_token_us: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(reps):
        for name, run in rows.items():
            gc.collect()
            gc.disable()
            start = time.perf_counter_ns()
            for output_ids in outputs.values():
                run(output_ids)
            elapsed_ns = time.perf_counter_ns() - start
            gc.enable()
            per_token_us[name].append(elapsed_ns / 1e3 / total_tokens)
    return per_token_us


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--reps", type=int, default=21, help="timed repetitions (median)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)

    tokenizer = load_tokenizer("default")
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(PROMPT_MESSAGES))
    outputs = {name: tokenizer.encode(text, False) for name, text in OUTPUTS.items()}
    mismatches = check_equal(tokenizer, prompt_ids, outputs)
    if mismatches:
        print("windowed and stream paths differ:", ", ".join(mismatches), file=sys.stderr)
        return 1
    decode_only = DecodeOnly(tokenizer)
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "cpus": os.cpu_count(),
        "tokenizers": tokenizers.__version__,
        "tokens": {name: len(ids) for name, ids in outputs.items()},
        "reps": args.reps,
        "median_us_per_token": {},
    }
    print(f"{result['date']}, {result['cpus']} CPUs, tokenizers {tokenizers.__version__},")
    print(f"output tokens {result['tokens']}, {args.reps} repetitions; emitted text equal")
    for stop_name, stops in STOP_SETS.items():
        rows = {
            "windowed": partial(detokenize, decode_only, prompt_ids, stops=stops),
            "stream": partial(detokenize, tokenizer, prompt_ids, stops=stops),
        }
        if not stops:
            rows["DecodeStream alone"] = partial(library_alone, tokenizer.backend, prompt_ids)
        samples = time_rows(rows, outputs, args.reps)
        medians = {name: statistics.median(values) for name, values in samples.items()}
        result["median_us_per_token"][stop_name] = medians
        report(stop_name, medians)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(result, out, indent=2)
    return 0


def report(stop_name: str, medians: dict[str, float]) -> None:
    """One block of the printed table: median us/token per row, ratio against windowed."""
    print(f"{stop_name}: median us per token (ratio to windowed)")
    for name, median_us in medians.items():
        print(f"  {name:<20} {median_us:7.3f}  ({median_us / medians['windowed']:.2f}x)")


if __name__ == "__main__":
    raise SystemExit(main())
