"""The engine thread: asyncio callers stream, cancel and get errors; the loop stays free."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

import pytest

from splitserve.common.errors import InvalidRequestError
from splitserve.common.grammar import GrammarSpec
from splitserve.common.request_update import FinishReason
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.checkpoint import LoadedCheckpoint
from splitserve.engine.llm import LLM
from tests.conftest import assert_no_leaks, make_llm
from tests.waiting import suspended_task, until, wait_until

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LONG_RUN = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
WAIT_S = 10.0
"""Bound on the waits for the engine thread (a hang fails the test instead of stalling it)."""


@pytest.fixture
def served(default_checkpoint_fp32: LoadedCheckpoint):
    """An offline engine and an AsyncEngine over it; shut down and leak-checked afterwards."""
    llm = make_llm(default_checkpoint_fp32, num_blocks=128)
    engine = AsyncEngine(llm.engine)
    yield llm, engine
    engine.shutdown()
    assert_no_leaks(llm)


async def _collect(engine: AsyncEngine, request_id: str, prompt: list[int]) -> list[int]:
    tokens: list[int] = []
    async for output in engine.generate(request_id, prompt, GREEDY):
        tokens.extend(output.update.new_token_ids)
    return tokens


def test_concurrent_streams_match_offline_and_loop_stays_responsive(served) -> None:
    llm, engine = served
    prompts = [llm.encode_prompt(text) for text in ("Hello there", "The sky is", "1, 2, 3,")]
    expected = [result.token_ids for result in llm.generate(prompts, GREEDY)]

    async def scenario() -> tuple[list[list[int]], int]:
        ticks = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.005)  # the ticker's beat: what is measured, not a wait

        ticking = asyncio.create_task(ticker())
        results = await asyncio.gather(
            *(_collect(engine, f"r{i}", prompt) for i, prompt in enumerate(prompts))
        )
        done.set()
        await ticking
        return list(results), ticks

    results, ticks = asyncio.run(scenario())
    assert results == expected
    assert ticks > 5  # the event loop kept running while the model worked


def test_cancel_and_invalid_request(served) -> None:
    llm, engine = served

    async def scenario() -> None:
        with pytest.raises(InvalidRequestError):
            async for _ in engine.generate("bad", [], GREEDY):
                pass
        stream = engine.generate("long", llm.encode_prompt("Count to a thousand:"), LONG_RUN)
        await anext(stream)
        await stream.aclose()  # leaving early aborts the request
        # The engine keeps serving after both.
        assert await _collect(engine, "after", llm.encode_prompt("Hi"))

    asyncio.run(scenario())
    _wait_idle(llm)


def test_a_grammar_compiles_before_the_request_reaches_a_step(served) -> None:
    """``submit`` compiles a request's structured output on a thread first: a bad one is
    refused there and never added; a good one's first step finds it compiled."""
    llm, engine = served
    compiler = llm.engine.runner.grammars.compiler
    prompt = llm.encode_prompt("Answer yes or no:")

    async def scenario() -> list[int]:
        bad = SamplingParams(max_tokens=4, grammar=GrammarSpec("regex", "(unclosed"))
        with pytest.raises(InvalidRequestError) as refused:
            await engine.submit("bad-grammar", prompt, bad)
        assert refused.value.param == "structured_outputs"
        assert not await engine.has_request("bad-grammar")
        params = SamplingParams(max_tokens=4, grammar=GrammarSpec.choice(["yes", "no"]))
        stream = await engine.submit("good-grammar", prompt, params)
        assert compiler.compile.cache_info().currsize >= 1  # compiled before any step
        tokens: list[int] = []
        async for output in stream:
            tokens.extend(output.update.new_token_ids)
        return tokens

    tokens = asyncio.run(scenario())
    assert llm.tokenizer.decode(tokens) in {"yes", "no"}


def _wait_idle(llm: LLM) -> None:
    """Wait until the engine has no unfinished request (an abort is a queued command)."""
    wait_until(lambda: not llm.engine.has_unfinished, WAIT_S, "no unfinished request")


def _wait_all_free(llm: LLM) -> None:
    """Wait until every KV block is back in the pool."""
    cache = llm.engine.kv_cache
    wait_until(lambda: cache.num_free_blocks == cache.num_blocks, WAIT_S, "every block free")


def test_outside_abort_ends_the_stream_and_a_failed_step_fails_only_running_requests(
    served,
) -> None:
    llm, engine = served
    prompt = llm.encode_prompt("Count to a thousand:")

    async def aborted_from_outside() -> list:
        outputs = []
        async for output in engine.generate("victim", prompt, LONG_RUN):
            outputs.append(output)
            if len(outputs) == 2:
                engine.abort("victim")  # e.g. a deadline handler in another task
        return outputs

    async def failing_step() -> None:
        real_step = llm.engine.step

        def broken_step(on_layer_kv_written=None, between_layers=None):
            llm.engine.step = real_step  # fail exactly once
            raise RuntimeError("simulated kernel failure")

        llm.engine.step = broken_step
        with pytest.raises(RuntimeError, match="simulated"):
            await _collect(engine, "unlucky", prompt)
        assert await _collect(engine, "next", llm.encode_prompt("Hi"))

    outputs = asyncio.run(asyncio.wait_for(aborted_from_outside(), timeout=60))
    assert outputs[-1].update.finish_reason is FinishReason.ABORT
    asyncio.run(asyncio.wait_for(failing_step(), timeout=60))


async def _cancel_while_being_accepted(submission: Coroutine[Any, Any, Any]) -> None:
    # suspended in submit: the add command is queued, not yet accepted (the acceptance comes
    # to this loop after the task's first step, so after this coroutine resumes)
    task = await suspended_task(submission)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_cancel_while_being_accepted_aborts(served) -> None:
    llm, engine = served
    prompt = llm.encode_prompt("Count to a thousand:")
    asyncio.run(_cancel_while_being_accepted(_collect(engine, "cancelled", prompt)))
    _wait_idle(llm)


def test_a_reservation_holds_its_blocks_until_released_whatever_ends_the_request(
    served,
) -> None:
    llm, engine = served
    prompt = llm.encode_prompt("The capital of France is")
    total = llm.engine.kv_cache.num_blocks

    async def scenario() -> None:
        stream = await engine.submit("remote", prompt, GREEDY, reserve_remote_prefill=True)
        table = list(stream.block_table or [])
        assert table and llm.engine.kv_cache.num_free_blocks == total - len(table)
        engine.abort("remote")  # the request ends (as on any exit path)...
        await engine.call(lambda: None)  # (commands run in order)
        assert "remote" not in llm.engine.scheduler.requests
        # ...but another worker may still be writing its KV there: the hold keeps the blocks
        assert llm.engine.kv_cache.num_free_blocks == total - len(table)
        engine.release_blocks(table)
        await engine.call(lambda: None)
        assert llm.engine.kv_cache.num_free_blocks == total

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


def test_a_reservation_cancelled_while_being_accepted_drops_its_hold(served) -> None:
    llm, engine = served
    prompt = llm.encode_prompt("The capital of France is")
    submission = engine.submit("remote", prompt, GREEDY, reserve_remote_prefill=True)
    asyncio.run(_cancel_while_being_accepted(submission))
    _wait_idle(llm)
    # The hold is given back by a command queued after the cancellation: wait for it to run
    # (on a loaded machine it may come after the request is gone), then the fixture checks.
    _wait_all_free(llm)


def test_the_engine_outlives_a_callers_closed_event_loop(served) -> None:
    """A command's result is told to its caller's loop after the load refresh; a caller that
    gave up and closed its loop meanwhile must not stop the engine thread (it did: the
    notice raised 'Event loop is closed' on that thread)."""
    _, engine = served
    started, release = threading.Event(), threading.Event()

    def held() -> int:
        started.set()
        assert release.wait(30)  # returns only once the caller's loop is closed
        return 1

    loop = asyncio.new_event_loop()
    task = loop.create_task(engine.call(held))
    # the loop runs (the task queues its command) until the engine thread is inside held()
    assert loop.run_until_complete(asyncio.to_thread(started.wait, 30)), "held() never ran"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        loop.run_until_complete(task)
    loop.close()
    release.set()  # its result now goes to the closed loop

    async def still_serving() -> tuple[int, list[int]]:
        answer = await engine.call(lambda: 42)
        return answer, await _collect(engine, "after", [1000 + i for i in range(8)])

    answer, tokens = asyncio.run(asyncio.wait_for(still_serving(), timeout=60))
    assert answer == 42 and len(tokens) > 0


def test_a_caller_that_fell_behind_reads_what_queued_up_as_one_output(served) -> None:
    """Outputs of steps the caller did not read yet come as one: every token once, in order,
    with the finish of the last (a relay that lags sends one message, not one per step)."""
    llm, engine = served
    prompt = llm.encode_prompt("Hello there")
    expected = llm.generate([prompt], GREEDY)[0].token_ids

    async def scenario() -> list:
        stream = await engine.submit("late", prompt, GREEDY)

        async def ended() -> bool:
            return not await engine.has_request("late")

        # The engine runs it to the end unread. Its outputs and the answer of has_request
        # cross to this loop in the engine's order (request_stream.py), the last outputs in
        # the round the request ended: once it is gone, every output is in the stream.
        await until(ended, WAIT_S, "the engine to run 'late' to its end")
        return [output async for output in stream]

    outputs = asyncio.run(scenario())
    assert len(outputs) == 1
    assert list(outputs[0].update.new_token_ids) == expected
    assert outputs[0].update.finish_reason is FinishReason.LENGTH
    assert outputs[0].update.num_output_tokens == GREEDY.max_tokens


def test_past_the_streams_per_interval_step_outputs_go_out_every_few_steps() -> None:
    """``stream_interval``: every step for a lone stream and up to the threshold; then one
    message per request every ceil(streams / threshold) steps, capped."""
    from splitserve.engine.async_engine import (
        MAX_STREAM_INTERVAL,
        STREAMS_PER_INTERVAL_STEP,
        stream_interval,
    )

    assert stream_interval(1) == 1
    assert stream_interval(STREAMS_PER_INTERVAL_STEP) == 1
    assert stream_interval(STREAMS_PER_INTERVAL_STEP + 1) == 2
    assert stream_interval(100 * STREAMS_PER_INTERVAL_STEP) == MAX_STREAM_INTERVAL


def test_many_streams_get_every_token_once_with_fewer_messages(
    served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the interval past 1 (the threshold lowered to 2 streams), each of 6 requests still
    gets exactly the offline tokens, its first token in a message of its own, in fewer
    messages than tokens."""
    from splitserve.engine import async_engine

    monkeypatch.setattr(async_engine, "STREAMS_PER_INTERVAL_STEP", 2)
    llm, engine = served
    prompts = [llm.encode_prompt(f"Count to ten, number {i}:") for i in range(6)]
    expected = [result.token_ids for result in llm.generate(prompts, GREEDY)]

    async def read(request_id: str, prompt: list[int]) -> list[tuple[int, ...]]:
        return [
            output.update.new_token_ids
            async for output in engine.generate(request_id, prompt, GREEDY)
        ]

    async def scenario() -> list[list[tuple[int, ...]]]:
        return list(await asyncio.gather(*(read(f"m{i}", p) for i, p in enumerate(prompts))))

    messages = asyncio.run(scenario())
    assert [[t for m in ms for t in m] for ms in messages] == expected
    assert all(len(ms[0]) == 1 for ms in messages)  # the first token is not held back
    assert sum(len(ms) for ms in messages) < sum(len(e) for e in expected)
