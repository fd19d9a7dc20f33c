"""Several choices of one prompt, forked (``n > 1``): one prompt computed once, each choice
decoding with its own seed (torch-free; the gateway and ``AsyncClient.generate_choices`` share
it).

Contracts:
- ``choice_samplings``: choice ``j`` samples with ``seed + j``, so each choice equals the
  single-choice request with its own seed.
- ``merged`` yields ``(choice index, item)`` in arrival order and ends when every stream
  ended; the first failure of any stream is raised (the others are cancelled); closing it
  closes every stream (their gRPC calls are cancelled). One stream is passed through without
  tasks or a queue.
- Forks: a stream may follow another (``leaders``): it starts only once its leader streamed
  its first item (or ended), so the prompt was computed once and its KV blocks sit in the
  prefix caches of the workers that served the leader. Given one session id, the choices
  decode on the same worker and each follower reserves the prompt's full blocks from its
  cache, shared with the leader; only the last partial block is computed and moved again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence
from dataclasses import replace

from splitserve.client.types import Chunk, Finish, Sampling

Item = Chunk | Finish


def choice_samplings(sampling: Sampling, n: int | None) -> list[Sampling]:
    """One request's ``n`` choices of a prompt: choice ``j`` samples with ``seed + j`` (mod
    2^63) when a seed was given, so choice 0 is the single-choice request with that seed and
    each choice equals a single-choice request with its own seed; unseeded, each draws its
    own randomness."""
    count = n or 1
    if sampling.seed is None:
        return [sampling] * count
    return [replace(sampling, seed=(sampling.seed + j) % 2**63) for j in range(count)]


async def merged(
    streams: Sequence[AsyncGenerator[Item, None]],
    leaders: Sequence[int | None] | None = None,
) -> AsyncGenerator[tuple[int, Item], None]:
    """Every stream's items tagged with its index, as they arrive; stream ``i`` starts once
    stream ``leaders[i]`` (an earlier one) gave its first item or ended (None, or no
    ``leaders``: at once) (module docstring)."""
    if len(streams) == 1:
        (stream,) = streams
        try:
            async for item in stream:
                yield 0, item
        finally:
            await stream.aclose()
        return
    queue: asyncio.Queue[tuple[int, Item | None, BaseException | None]] = asyncio.Queue()
    started = [asyncio.Event() for _ in streams]
    """Set at a stream's first item or its end: its followers may start."""

    async def pump(index: int, stream: AsyncGenerator[Item, None]) -> None:
        leader = None if leaders is None else leaders[index]
        if leader is not None:
            await started[leader].wait()
        try:
            async for item in stream:
                started[index].set()
                await queue.put((index, item, None))
        except Exception as error:  # noqa: BLE001 - handed to the consumer, raised there
            await queue.put((index, None, error))
            return
        finally:
            started[index].set()
        await queue.put((index, None, None))  # this stream ended

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        ended = 0
        while ended < len(streams):
            index, item, error = await queue.get()
            if error is not None:
                raise error
            if item is None:
                ended += 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            with contextlib.suppress(Exception):
                await stream.aclose()
