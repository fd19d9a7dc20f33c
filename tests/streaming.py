"""Many streams at once through one ``AsyncClient``, for fault tests: start them, wait until
every one has some tokens (then kill or stop something), collect what each one streamed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from splitserve.client import AsyncClient, Chunk, Finish, Sampling

START_TIMEOUT_S = 120.0
FINISH_TIMEOUT_S = 300.0

Streamed = tuple[tuple[int, ...], str]
"""One stream's token ids and finish reason."""


class ConcurrentStreams:
    """``prompts`` streamed at once, stream ``i`` with ``sampling(i)``; see the module doc."""

    def __init__(
        self,
        client: AsyncClient,
        prompts: Sequence[str],
        sampling: Callable[[int], Sampling],
    ) -> None:
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.finishes = [""] * len(prompts)
        self._tasks = [
            asyncio.create_task(self._consume(client, index, prompt, sampling(index)))
            for index, prompt in enumerate(prompts)
        ]

    async def _consume(
        self, client: AsyncClient, index: int, prompt: str, sampling: Sampling
    ) -> None:
        async for item in client.stream(prompt, sampling=sampling):
            if isinstance(item, Chunk):
                self.tokens[index].extend(item.token_ids)
            elif isinstance(item, Finish):
                self.finishes[index] = item.finish_reason

    async def each_has(self, count: int) -> None:
        """Return once every stream has ``count`` tokens; fails the test if one ends first
        or they take longer than ``START_TIMEOUT_S``."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while min(len(tokens) for tokens in self.tokens) < count:
            assert time.monotonic() < deadline, f"streams did not reach {count} tokens"
            assert not any(task.done() for task in self._tasks), "a stream ended early"
            await asyncio.sleep(0.02)

    async def results(self) -> list[Streamed]:
        """Every stream's tokens and finish reason once all ended (a failed one raises)."""
        await asyncio.wait_for(asyncio.gather(*self._tasks), FINISH_TIMEOUT_S)
        return [(tuple(t), f) for t, f in zip(self.tokens, self.finishes, strict=True)]
