"""What storing a Responses API response costs the request, per store, same run: the time of
one ``StoredResponses.put`` (what a stored response waits for before its last event goes out)
and of one ``get`` (what a ``previous_response_id`` waits for before its prompt is made), and
of adding one exchange to a conversation of as many turns (``Conversations.add_turn``: a read
and a ``replace`` over it, what a response naming a ``conversation`` waits for before its last
event), for
records of a short exchange, of a conversation of 20 turns and of one of 4,000 (about 2.6 MB:
past etcd's 1.5 MiB request limit, so kept in parts there), against the ``memory`` store (the
baseline) in the same run. The stores: this process's memory, a SQLite file (``up
--gateways N``'s), and a real etcd on localhost (``tests/etcd.py``'s, as the suite runs it)
as the gateway keeps it: values over 1 MiB in parts (``common/chunked_store.py``). The long
conversation takes a tenth of ``--reps`` (at least 20).

Median and p99 over ``--reps`` puts and gets each, after ``--warmup``. Prints rows to stderr
and the JSON report to stdout (``--out`` writes it too). Nothing asserted.

    .venv/bin/python bench/bench_response_store.py --out bench/results/response-store-<date>.json
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from machine_bound import cpu_name
from timing_stats import Json, emit_report, log_row, percentile, wait_for_quiet

from splitserve.common.chunked_store import ChunkedStore
from splitserve.common.response_store import (
    MemoryResponseStore,
    ResponseStore,
    SqliteResponseStore,
)
from splitserve.discovery.etcd_response_store import PART_BYTES, EtcdResponseStore
from splitserve.gateway.conversations import Conversations
from splitserve.gateway.stored_responses import StoredResponse, StoredResponses, input_items
from splitserve.proto.etcd_client import EtcdClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.etcd import running_etcd  # noqa: E402 - the suite's real etcd

SAID = "The weather in Paris is sunny with a light breeze and 21 degrees. " * 3
"""One message of the conversations (~200 characters)."""
LONG_TURNS = 4000
"""The long conversation's exchanges: a record of about 2.6 MB."""


def _record(response_id: str, turns: int) -> StoredResponse:
    """A stored response of a conversation of ``turns`` exchanges."""
    items: list[dict[str, object]] = []
    for turn in range(turns):
        items += input_items([{"role": "user", "content": f"Question {turn}: {SAID}"}])
        items += input_items([{"role": "assistant", "content": SAID}])
    output = [{"type": "message", "id": "msg_x", "status": "completed", "role": "assistant",
               "content": [{"type": "output_text", "text": SAID, "annotations": []}]}]  # fmt: skip
    response = {"id": response_id, "object": "response", "output": output, "store": True}
    return StoredResponse(response, items, "team-a", "s-1")


async def _time(stored: StoredResponses, turns: int, reps: int, warmup: int) -> Json:
    puts, gets, adds = [], [], []
    conversations = Conversations(stored)
    for index in range(warmup + reps):
        record = _record(f"resp-{turns}-{index}", turns)
        started = time.perf_counter()
        await stored.put(record)
        put_s = time.perf_counter() - started
        started = time.perf_counter()
        await stored.get(f"resp-{turns}-{index}", "team-a")
        get_s = time.perf_counter() - started
        made = await conversations.create("team-a", record.input_items, {})
        started = time.perf_counter()
        await conversations.add_turn(made.conversation_id, "team-a", _turn())
        add_s = time.perf_counter() - started
        if index >= warmup:
            puts.append(put_s * 1e6)
            gets.append(get_s * 1e6)
            adds.append(add_s * 1e6)
    return {
        "record_bytes": len(_record("resp-x", turns).to_bytes()),
        "failed_puts": stored.failed_puts,
        "put_us_p50": statistics.median(puts),
        "put_us_p99": percentile(puts, 99),
        "get_us_p50": statistics.median(gets),
        "get_us_p99": percentile(gets, 99),
        "turn_added_us_p50": statistics.median(adds),
        "turn_added_us_p99": percentile(adds, 99),
    }


def _turn() -> list[dict[str, object]]:
    """One exchange, as a response adds it to its conversation."""
    return input_items([{"role": "user", "content": f"Again: {SAID}"}]) + input_items(
        [{"role": "assistant", "content": SAID}]
    )


async def _measure(args: argparse.Namespace, etcd_endpoint: str, folder: Path) -> list[Json]:
    etcd = EtcdResponseStore(EtcdClient((etcd_endpoint,)), "bench")
    stores: list[tuple[str, ResponseStore]] = [
        ("memory", MemoryResponseStore(1 << 30)),
        ("sqlite", SqliteResponseStore(folder / "responses.db")),
        ("etcd", ChunkedStore(etcd, PART_BYTES)),  # as the gateway keeps it
    ]
    rows = []
    for turns in (1, 20, LONG_TURNS):
        base: Json | None = None
        reps = args.reps if turns < LONG_TURNS else max(20, args.reps // 10)
        warmup = args.warmup if turns < LONG_TURNS else max(3, args.warmup // 10)
        for name, store in stores:
            timed = await _time(StoredResponses(store), turns, reps, warmup)
            row = {"store": name, "turns": turns, "reps": reps, **timed}
            base = base or row
            row["put_vs_memory"] = row["put_us_p50"] / base["put_us_p50"]
            row["get_vs_memory"] = row["get_us_p50"] / base["get_us_p50"]
            row["turn_added_vs_memory"] = row["turn_added_us_p50"] / base["turn_added_us_p50"]
            log_row(row)
            rows.append(row)
    for _, store in stores:
        await store.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    busy = wait_for_quiet(30.0)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "etcd").mkdir()
        with running_etcd(Path(tmp) / "etcd") as etcd:
            rows = asyncio.run(_measure(args, etcd.endpoint, Path(tmp)))
    report = {"cpu": cpu_name(), "busy_fraction_before": busy, "reps": args.reps, "rows": rows}
    emit_report(report, args.out)


if __name__ == "__main__":
    main()
