"""Conversations (issue 33): what each turn of a chat computes and moves, on ``make serve``.

``--conversations`` chats run side by side through the gateway's ``/v1/chat/completions``
(streamed, greedy, ``--reply-tokens`` tokens a reply with EOS ignored): a ~200-token system
prompt, then ``--turns`` user messages, each turn sending the whole history so far (the
earlier replies as the model wrote them). Turn ``k`` of every conversation is sent at once,
and the next turn only once all have answered, so each turn's figures are its own:

- ``prompt_tokens`` and ``computed_tokens`` (the prompt less ``cached_tokens`` of the usage:
  what some worker computed again), means over the conversations;
- ``kv_mb``: KV bytes that landed in the decode worker (its
  ``splitserve_kv_transfer_bytes_total{direction=receive}``), and ``reused_blocks``: blocks of
  pushed prompts it already held (``splitserve_kv_reused_blocks_total``; absent in trees
  before it);
- ``ttft_ms``: time to the first streamed token, median over the conversations;
- the coordinator's placement decisions during the turn (where, reason).

With ``--baseline-tree`` (e.g. a git worktree of an earlier commit) the same conversations run
against that tree's cluster too, a fresh cluster per tree and repetition, the trees
alternating. Prints rows to stderr and the JSON report to stdout (``--out`` writes it too).
Nothing asserted.

    .venv/bin/python bench/bench_conversation.py --baseline-tree /tmp/before \\
        --out bench/results/conversation-<date>.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import httpx
from bench_security import tree_cluster
from cluster_process import LocalCluster
from machine_bound import cpu_name
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from timing_stats import Json, emit_report, log_row, wait_for_quiet

SYSTEM = (
    "You are a patient assistant for a small bookshop in a harbour town. You answer questions "
    "about books, opening hours, orders and events. Keep answers friendly and short, suggest "
    "one or two titles when asked for recommendations, and never invent prices or stock: say "
    "you will check instead. The shop opens at nine and closes at six, Monday to Saturday; "
    "on Sundays it opens from ten to two. Events happen on the first Thursday of each month, "
    "usually a reading by a local author followed by tea. Orders arrive within three working "
    "days; customers can collect them at the counter or have them delivered in town for a "
    "small fee. The shop has sections for fiction, history, the sea, travel and children."
)
QUESTIONS = (
    "Can you recommend a novel about the sea?",
    "What time do you open on Sunday?",
    "Is there an event this month?",
    "How long does an order take to arrive?",
    "Do you have a children's section?",
    "Can I have a book delivered?",
    "Which section has travel books?",
    "Thank you, that is all for today.",
)


def scrape(url: str) -> list[Sample]:
    """Every sample on a /metrics page."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def counter(samples: Sequence[Sample], name: str, **labels: str) -> float:
    """A counter summed over the samples whose labels include ``labels``."""
    return sum(
        sample.value
        for sample in samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def placements(samples: Sequence[Sample]) -> dict[str, float]:
    """``where/reason`` -> decisions so far, from the coordinator's samples."""
    return {
        f"{sample.labels['where']}/{sample.labels['reason']}": sample.value
        for sample in samples
        if sample.name == "splitserve_placement_decisions_total"
    }


def decode_figures(url: str) -> tuple[float, float]:
    """(KV bytes landed, blocks reused) so far on the decode worker."""
    samples = scrape(url)
    landed = counter(samples, "splitserve_kv_transfer_bytes_total", direction="receive")
    return landed, counter(samples, "splitserve_kv_reused_blocks_total")


async def one_turn(
    client: httpx.AsyncClient, model: str, messages: list[dict[str, str]], reply_tokens: int
) -> tuple[str, Json, float]:
    """The streamed reply's text, its usage and the time to its first token (s)."""
    body = {
        "model": model, "messages": messages, "max_tokens": reply_tokens, "temperature": 0,
        "min_tokens": reply_tokens, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    text, usage, first = "", {}, None
    started = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            for choice in event.get("choices", []):
                delta = choice.get("delta", {}).get("content")
                if delta:
                    first = first if first is not None else time.perf_counter() - started
                    text += delta
            usage = event.get("usage") or usage
    return text, usage, first if first is not None else float("nan")


async def conversations(args: argparse.Namespace, url: str, metrics: dict[str, str]) -> list:
    """Every turn's figures (module docstring)."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        chats = [[{"role": "system", "content": SYSTEM}] for _ in range(args.conversations)]
        rows = []
        for turn in range(args.turns):
            for index, chat in enumerate(chats):
                question = QUESTIONS[(turn + index) % len(QUESTIONS)]
                chat.append({"role": "user", "content": question})
            kv_before, reused_before = decode_figures(metrics["decode"])
            placed_before = placements(scrape(metrics["coordinator"]))
            answers = await asyncio.gather(
                *(one_turn(client, model, chat, args.reply_tokens) for chat in chats)
            )
            kv_after, reused_after = decode_figures(metrics["decode"])
            placed_after = placements(scrape(metrics["coordinator"]))
            for chat, (text, _, _) in zip(chats, answers, strict=True):
                chat.append({"role": "assistant", "content": text})
            usages = [usage for _, usage, _ in answers]
            cached = [
                (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usages
            ]
            row = {
                "turn": turn + 1,
                "prompt_tokens": statistics.mean(u["prompt_tokens"] for u in usages),
                "computed_tokens": statistics.mean(
                    u["prompt_tokens"] - c for u, c in zip(usages, cached, strict=True)
                ),
                "kv_mb": round((kv_after - kv_before) / 1e6, 2),
                "reused_blocks": reused_after - reused_before,
                "ttft_ms": round(statistics.median(first for *_, first in answers) * 1e3, 1),
                "placements": {
                    key: value - placed_before.get(key, 0)
                    for key, value in placed_after.items()
                    if value - placed_before.get(key, 0)
                },
            }
            rows.append(row)
    return rows


def metrics_urls(cluster: LocalCluster) -> dict[str, str]:
    """The coordinator's and the decode worker's /metrics, from ``up``'s log."""
    urls = {}
    for role in ("coordinator", "decode"):
        (line,) = cluster.log_lines(f"{role} metrics at ")[:1]
        urls[role] = line.rsplit(" ", 1)[1].strip()
    return urls


def run_tree(args: argparse.Namespace, name: str, tree: Path | None, rep: int) -> Json:
    log_path = Path(tempfile.mkdtemp(prefix=f"conversation-{name}-")) / "up.log"
    with tree_cluster(args.up_flags.split(), log_path, tree) as cluster:
        wait_for_quiet(args.wait_quiet_s)
        rows = asyncio.run(conversations(args, cluster.http_url, metrics_urls(cluster)))
    for row in rows:
        log_row({"tree": name, "rep": rep, **row})
    return {"tree": name, "rep": rep, "turns": rows}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--reply-tokens", type=int, default=48)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--up-flags", default="--placement adaptive", help="make serve's")
    parser.add_argument("--baseline-tree", type=Path, default=None)
    parser.add_argument("--wait-quiet-s", type=float, default=20.0)
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    report: Json = {
        "machine": {"cpu": cpu_name()},
        "setup": {key: str(value) for key, value in vars(args).items() if key != "out"},
        "runs": [],
    }
    trees: list[tuple[str, Path | None]] = [("this", None)]
    if args.baseline_tree is not None:
        trees.insert(0, ("baseline", args.baseline_tree))
    for rep in range(args.reps):
        for name, tree in trees:
            report["runs"].append(run_tree(args, name, tree, rep))
    emit_report(report, args.out)


if __name__ == "__main__":
    main()
