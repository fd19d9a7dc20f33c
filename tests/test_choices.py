"""Several choices behind one response (``gateway/choices.py``): the merged streams and the
usage rule, on plain async generators (the gateway's integration test drives them through a
real cluster)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from splitserve.client import Chunk, Finish, Usage
from splitserve.client.choices import merged
from splitserve.gateway.choices import Choices
from splitserve.gateway.responses import CompletionBuilder


def _chunk(text: str, usage: Usage) -> Chunk:
    return Chunk("r", text, (1,), (), usage)


async def _stream(
    items: list[Chunk | Finish], delay_s: float = 0.0, closed: list[int] | None = None
) -> AsyncGenerator[Chunk | Finish, None]:
    try:
        for item in items:
            await asyncio.sleep(delay_s)
            yield item
    finally:
        if closed is not None:
            closed.append(1)


def test_merged_interleaves_by_arrival_and_ends_when_every_stream_ended() -> None:
    usage = Usage(3, 1, 0)
    fast = _stream([_chunk("a", usage), Finish("r", "length", None, usage)], 0.001)
    slow = _stream([_chunk("b", usage), Finish("r", "length", None, usage)], 0.05)

    async def scenario() -> list[tuple[int, str]]:
        return [
            (index, item.text if isinstance(item, Chunk) else item.finish_reason)
            async for index, item in merged([slow, fast])
        ]

    assert asyncio.run(scenario()) == [(1, "a"), (1, "length"), (0, "b"), (0, "length")]


def test_a_failing_stream_fails_the_merge_and_closes_the_others() -> None:
    closed: list[int] = []

    async def failing() -> AsyncGenerator[Chunk | Finish, None]:
        await asyncio.sleep(0.01)
        raise RuntimeError("worker lost")
        yield  # an async generator

    async def scenario() -> None:
        usage = Usage(1, 1, 0)
        endless = _stream([_chunk("x", usage)] * 1000, 0.005, closed)
        async for _ in merged([endless, failing()]):
            pass

    with pytest.raises(RuntimeError, match="worker lost"):
        asyncio.run(scenario())
    assert closed == [1]


def test_usage_counts_each_prompt_once_and_every_completion() -> None:
    builders = [CompletionBuilder("cmpl-r", "m", False, index) for index in range(4)]
    choices = Choices(builders, prompt_of=[0, 0, 1, 1])
    for index, (prompt_tokens, completion_tokens) in enumerate([(5, 2), (5, 3), (7, 1), (7, 4)]):
        usage = Usage(prompt_tokens, completion_tokens, cached_tokens=prompt_tokens - 1)
        choices.add(index, Finish("r", "length", None, usage))
    assert choices.all_finished
    assert choices.usage() == Usage(prompt_tokens=12, completion_tokens=10, cached_tokens=10)
    body = choices.whole()
    assert [choice["index"] for choice in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["total_tokens"] == 22
