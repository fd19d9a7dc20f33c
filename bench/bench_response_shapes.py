"""What each response shape costs the gateway a streamed token: its builder and SSE framing.

In one process, for completions, chat completions and the Responses API, a builder
(``gateway/responses.py``, ``gateway/responses_events.py``) folds ``--tokens`` chunks of one
token each (then the finish) and frames every event it returns as its endpoint streams it
(``gateway/reply.py:SseFraming``). Prints the microseconds a token, the median of ``--repeats``
runs of each shape, alternating, and each shape's ratio to chat's. What it leaves out (the
gRPC or in-process stream, the HTTP write) is the same for every shape:
``bench_relay_cpu.py`` measures the whole front end.

    .venv/bin/python bench/bench_response_shapes.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from splitserve.client import Chunk, Finish, Usage
from splitserve.common.cpu_info import cpu_name
from splitserve.gateway.reply import DATA_FRAMING, TYPED_FRAMING, SseFraming
from splitserve.gateway.responses import ChatBuilder, CompletionBuilder, ResponseBuilder
from splitserve.gateway.responses_events import ResponsesBuilder
from splitserve.gateway.responses_schemas import ResponsesRequest

SHAPES: dict[str, tuple[Callable[[], ResponseBuilder], SseFraming]] = {
    "completions": (lambda: CompletionBuilder("cmpl-r", "m", False), DATA_FRAMING),
    "chat": (lambda: ChatBuilder("chatcmpl-r", "m", False), DATA_FRAMING),
    "responses": (
        lambda: ResponsesBuilder("resp-r", "m", ResponsesRequest(input="hi"), None),
        TYPED_FRAMING,
    ),
}


def stream_bytes(builder: ResponseBuilder, framing: SseFraming, chunks: list[Chunk]) -> int:
    """Every byte one stream of ``chunks`` writes."""
    written = sum(len(framing.frame(event)) for event in builder.opening_chunks())
    for chunk in chunks:
        written += len(b"".join(framing.frame(event) for event in builder.add(chunk)))
    end = Finish("r", "length", None, chunks[-1].usage)
    return written + sum(len(framing.frame(event)) for event in builder.finish(end))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    usage = Usage(10, 1, 0)
    chunks = [Chunk("r", " word", (5,), (), usage) for _ in range(args.tokens)]
    runs: dict[str, list[float]] = {name: [] for name in SHAPES}
    written: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, (make, framing) in SHAPES.items():
            builder = make()
            started = time.perf_counter()
            written[name] = stream_bytes(builder, framing, chunks)
            runs[name].append((time.perf_counter() - started) / args.tokens * 1e6)
    us = {name: round(statistics.median(values), 3) for name, values in runs.items()}
    report = {
        "cpu": cpu_name(),
        "tokens": args.tokens,
        "us_per_token": us,
        "ratio_to_chat": {name: round(value / us["chat"], 2) for name, value in us.items()},
        "bytes_per_token": {name: round(b / args.tokens, 1) for name, b in written.items()},
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
