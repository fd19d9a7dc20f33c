"""A decode worker's reservations that find the KV pool short wait in arrival order, without
polling, on a real engine (``engine/reservation_queue.py`` behind ``AsyncEngine.submit``).

The pool has 8 blocks of 16 tokens. A reservation that does not fit waits; a later one that
would fit waits behind it (no overtaking); freeing blocks grants them in order; an abort or a
cancelled submitter leaves the queue at once and the ones behind move up; one more than the
bound is refused at once; shutdown ends the waits with ``EngineStoppedError``; waiting
reservations count as waiting requests in the load figures. Every block is back afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import pytest

from splitserve.common.errors import CapacityError, EngineStoppedError
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.async_engine import AsyncEngine, RequestStream
from splitserve.engine.checkpoint import LoadedCheckpoint
from splitserve.engine.llm import LLM
from tests.conftest import assert_no_leaks, make_llm

T = TypeVar("T")
NUM_BLOCKS = 8
BLOCK_SIZE = 16
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
MAX_WAITING = 3


def prompt(num_blocks: int) -> list[int]:
    """A prompt filling exactly ``num_blocks`` blocks."""
    return list(range(100, 100 + num_blocks * BLOCK_SIZE))


@pytest.fixture
def served(default_checkpoint_fp32: LoadedCheckpoint):
    llm = make_llm(default_checkpoint_fp32, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    engine = AsyncEngine(llm.engine, max_waiting_reservations=MAX_WAITING)
    yield llm, engine
    engine.shutdown()
    assert_no_leaks(llm)


def run(scenario: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(scenario, timeout=60))


def reserve(engine: AsyncEngine, request_id: str, num_blocks: int) -> asyncio.Task[RequestStream]:
    return asyncio.create_task(
        engine.submit(request_id, prompt(num_blocks), PARAMS, reserve_remote_prefill=True)
    )


async def settle(engine: AsyncEngine) -> None:
    """Every command queued so far has run (and the queue was served after it), and the
    load figures show it. Tasks created just before (``reserve``) first get to queue their
    commands: the no-op command must land after theirs."""
    await asyncio.sleep(0)
    await engine.call(lambda: None)
    await asyncio.sleep(0)  # the loop delivers what the engine thread settled


async def end(engine: AsyncEngine, request_id: str, table: Sequence[int]) -> None:
    """End a reserved request and give its hold back, as the decode worker does."""
    engine.abort(request_id)
    engine.release_blocks(table)
    await settle(engine)


def free_blocks(llm: LLM) -> int:
    return llm.engine.kv_cache.num_free_blocks


def test_reservations_are_granted_in_arrival_order_when_blocks_free_up(served) -> None:
    llm, engine = served

    async def scenario() -> None:
        first = await reserve(engine, "first", 5)
        assert first.block_table is not None and free_blocks(llm) == 3
        big = reserve(engine, "big", 4)  # 4 > 3 free: waits
        small = reserve(engine, "small", 1)  # would fit, but must not overtake "big"
        await settle(engine)
        assert not big.done() and not small.done()
        assert free_blocks(llm) == 3  # nothing was reserved for the waiting ones
        assert engine.latest_load.num_waiting_requests == 2

        await end(engine, "first", first.block_table)
        big_stream, small_stream = await big, await small
        assert len(big_stream.block_table or ()) == 4
        assert len(small_stream.block_table or ()) == 1
        assert free_blocks(llm) == NUM_BLOCKS - 5
        assert engine.latest_load.num_waiting_requests == 0
        await end(engine, "big", big_stream.block_table or ())
        await end(engine, "small", small_stream.block_table or ())

    run(scenario())


def test_an_aborted_or_cancelled_wait_leaves_the_queue_and_the_next_moves_up(served) -> None:
    llm, engine = served

    async def scenario() -> None:
        first = await reserve(engine, "first", 6)
        aborted = reserve(engine, "aborted", 4)
        cancelled = reserve(engine, "cancelled", 4)
        behind = reserve(engine, "behind", 2)
        await settle(engine)
        assert not any(task.done() for task in (aborted, cancelled, behind))

        engine.abort("aborted")  # e.g. the coordinator gave the request up
        cancelled.cancel()  # the submitter itself went away
        with pytest.raises(asyncio.CancelledError):
            await aborted
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        await settle(engine)
        # "behind" needs 2 and 2 are free: with both ahead of it gone, it is granted
        behind_stream = await behind
        assert len(behind_stream.block_table or ()) == 2 and free_blocks(llm) == 0
        assert engine.latest_load.num_waiting_requests == 0
        await end(engine, "first", first.block_table or ())
        await end(engine, "behind", behind_stream.block_table or ())

    run(scenario())


def test_one_more_than_the_bound_is_refused_at_once(served) -> None:
    llm, engine = served

    async def scenario() -> None:
        first = await reserve(engine, "first", NUM_BLOCKS - 1)
        waiting = [reserve(engine, f"w{i}", 2) for i in range(MAX_WAITING)]
        await settle(engine)
        with pytest.raises(CapacityError, match="already wait"):
            await reserve(engine, "one-too-many", 2)
        assert not any(task.done() for task in waiting)
        await end(engine, "first", first.block_table or ())
        for i, task in enumerate(waiting):
            await end(engine, f"w{i}", (await task).block_table or ())

    run(scenario())
    assert free_blocks(llm) == NUM_BLOCKS


def test_a_request_that_can_never_fit_is_refused_even_behind_a_wait(served) -> None:
    llm, engine = served

    async def scenario() -> None:
        first = await reserve(engine, "first", NUM_BLOCKS - 1)
        waiting = reserve(engine, "waiting", 2)
        await settle(engine)
        too_long = SamplingParams(max_tokens=1, temperature=0.0)
        with pytest.raises(Exception, match="KV cache|context"):
            await engine.submit(
                "huge", prompt(NUM_BLOCKS) + [5], too_long, reserve_remote_prefill=True
            )
        await end(engine, "first", first.block_table or ())
        await end(engine, "waiting", (await waiting).block_table or ())

    run(scenario())


def test_shutdown_ends_every_wait_with_engine_stopped(
    default_checkpoint_fp32: LoadedCheckpoint,
) -> None:
    llm = make_llm(default_checkpoint_fp32, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    engine = AsyncEngine(llm.engine)

    async def scenario() -> None:
        await reserve(engine, "first", NUM_BLOCKS - 1)
        waiting = reserve(engine, "waiting", 2)
        await settle(engine)
        engine.shutdown()
        with pytest.raises(EngineStoppedError):
            await waiting

    run(scenario())
