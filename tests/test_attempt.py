"""One attempt's protocol on plain objects (torch-free): the decode stream is the one source of
tokens, events may arrive in any order, and every exit cancels both worker calls and gives
back the router's pending counts. Real processes and gRPC are exercised by the integration
tests; here the workers are scripted so that each ordering is tested on purpose."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import AsyncIterator, Sequence

import pytest

from splitserve.common.errors import InvalidRequestError, WorkerUnavailableError
from splitserve.common.load import EngineLoad
from splitserve.common.membership import Role
from splitserve.common.output_processor import RequestTracker
from splitserve.common.request_update import FinishReason, RequestUpdate, StepOutput
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.step_cost import StepCost
from splitserve.coordinator.attempt import (
    PER_STREAM_STALL_FACTOR,
    Attempt,
    AttemptTimeouts,
    DecodeLost,
    DecodeStalled,
    PrefillLost,
    PrefillStalled,
    prefill_stall_limit_s,
    stall_limit_s,
)
from splitserve.coordinator.registry import WorkerRecord, WorkerRegistry
from splitserve.coordinator.router import Route, Router, RoutingConfig
from splitserve.proto.splitserve.v1 import worker_pb2
from splitserve.proto.worker_clients import RelayedReservation
from splitserve.transfer.reservation import PrefillDone
from tests.request_records import record

PROMPT = [1, 2, 3, 4, 5]
RESERVATION = RelayedReservation(
    worker_pb2.KvReservation(transfer_id=7, decode_address="decode:1", num_tokens=len(PROMPT))
)
_END = object()


class _Letters:
    """A decoder whose text for token t is chr(ord('a') + t)."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + token) for token in token_ids)


class _DecodeCall:
    def __init__(self) -> None:
        self.items: asyncio.Queue[object] = asyncio.Queue()
        self.cancelled = False

    async def __aiter__(self) -> AsyncIterator[object]:
        while (item := await self.items.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self) -> None:
        self.cancelled = True
        self.items.put_nowait(_END)


class _Workers:
    """Scripted decode and prefill workers behind the ``WorkerChannels`` interface."""

    def __init__(self) -> None:
        self.call = _DecodeCall()
        self.prefill_result: asyncio.Future[PrefillDone] | None = None
        self.prefill_cancelled = False
        self.stopped: list[tuple[str, bool]] = []

    def decode(self, address: str) -> _DecodeClient:
        return _DecodeClient(self)

    def prefill(self, address: str) -> _PrefillClient:
        return _PrefillClient(self)


class _DecodeClient:
    def __init__(self, workers: _Workers) -> None:
        self._workers = workers

    def generate(self, *args: object, **kwargs: object) -> _DecodeCall:
        return self._workers.call

    async def stop(self, request_id: str, as_stopped: bool, timeout_s: float) -> bool:
        self._workers.stopped.append((request_id, as_stopped))
        return True


class _PrefillClient:
    def __init__(self, workers: _Workers) -> None:
        self._workers = workers

    async def prefill(self, *args: object, **kwargs: object) -> PrefillDone:
        """Answers when the test settles ``prefill_result``."""
        result = asyncio.get_running_loop().create_future()
        self._workers.prefill_result = result
        try:
            return await result
        except asyncio.CancelledError:
            self._workers.prefill_cancelled = True
            raise


def _record(worker_id: str, role: Role) -> WorkerRecord:
    return WorkerRecord(
        worker_id, role, f"{worker_id}:1", "hash", 16, "float32", 100, 4096, EngineLoad(100)
    )


def _attempt(
    workers: _Workers,
    remote: bool = True,
    stop: tuple[str, ...] = (),
    timeouts: AttemptTimeouts | None = None,
    lone_decode: bool = False,
) -> tuple[Attempt, Router]:
    """The attempt's decode worker is "d"; unless ``lone_decode``, a second decode worker
    is heard from throughout (``last_seen`` ahead of any clock reading), so a silence of
    "d" is its own (``Attempt._heard_elsewhere``)."""
    decode, prefill = _record("d", Role.DECODE), _record("p", Role.PREFILL)
    registry = WorkerRegistry()
    registry.register(decode)
    registry.register(prefill)
    if not lone_decode:
        heard = _record("d2", Role.DECODE)
        heard.last_seen = math.inf
        registry.register(heard)
    router = Router(registry, RoutingConfig())
    params = SamplingParams(max_tokens=8, stop=stop)
    tracker = RequestTracker("r", PROMPT, params, _Letters())
    route = Route(decode, prefill if remote else None)
    attempt = Attempt(
        record(PROMPT, 8, params=params),
        tracker,
        route,
        router,
        workers,  # type: ignore[arg-type]
        timeouts or AttemptTimeouts(),
    )
    return attempt, router


def _output(tokens: tuple[int, ...], count: int, finish: FinishReason | None = None) -> StepOutput:
    update = RequestUpdate("r", tokens, finish, len(PROMPT), 3, count)
    return StepOutput(update)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_first_token_comes_once_from_the_decode_stream_before_the_prefill_answers() -> None:
    async def body() -> None:
        workers = _Workers()
        attempt, router = _attempt(workers)
        chunks = []

        async def consume() -> None:
            async for chunk in attempt.run():
                chunks.append(chunk)

        task = asyncio.create_task(consume())
        workers.call.items.put_nowait(RESERVATION)
        await _settle()
        assert router._prefill_sent["p:1"] == len(PROMPT)
        workers.call.items.put_nowait(_output((7,), 1))  # the KV landed: first token
        await _settle()
        workers.call.items.put_nowait(_output((8,), 2, FinishReason.LENGTH))
        await asyncio.wait_for(task, 5)
        assert [chunk.new_token_ids for chunk in chunks] == [(7,), (8,)]
        assert "".join(chunk.text for chunk in chunks) == "hi"
        assert attempt.num_cached_tokens == 3  # from the decode stream's usage
        assert [name for name, _ in attempt.stage_seconds] == ["reserve", "prefill"]
        assert workers.call.cancelled and workers.prefill_cancelled  # every exit ends both
        assert len(router._pending["d"].decoding) == 0
        assert router._prefill_sent["p:1"] == 0

    asyncio.run(body())


def test_outputs_that_queued_up_go_out_as_one_chunk_and_events_keep_their_order() -> None:
    """A coordinator that fell behind: three decoded outputs waiting at once make one chunk
    (every token once, in order, the last one's finish); an event queued behind them (the
    stream's end) is still handled after them."""

    async def body() -> None:
        workers = _Workers()
        attempt, _ = _attempt(workers, remote=False)
        for output in (_output((0,), 1), _output((1, 2), 3), _output((3,), 4)):
            workers.call.items.put_nowait(output)
        workers.call.items.put_nowait(WorkerUnavailableError("gone"))  # then the stream breaks
        chunks = []
        with pytest.raises(DecodeLost):
            async for chunk in attempt.run():
                chunks.append(chunk)
        assert [chunk.new_token_ids for chunk in chunks] == [(0, 1, 2, 3)]
        assert chunks[0].text == "abcd" and chunks[0].finish_reason is None

        workers = _Workers()
        attempt, _ = _attempt(workers, remote=False)
        for output in (_output((4,), 1), _output((5,), 2, FinishReason.LENGTH)):
            workers.call.items.put_nowait(output)
        chunks = [chunk async for chunk in attempt.run()]
        assert [chunk.new_token_ids for chunk in chunks] == [(4, 5)]
        assert chunks[0].finish_reason is FinishReason.LENGTH

    asyncio.run(body())


def test_a_prefill_failure_after_the_first_token_changes_nothing() -> None:
    async def body() -> None:
        workers = _Workers()
        attempt, _ = _attempt(workers)
        stream = attempt.run()
        workers.call.items.put_nowait(RESERVATION)
        workers.call.items.put_nowait(_output((7,), 1))
        assert (await anext(stream)).new_token_ids == (7,)
        await _settle()  # the prefill call is under way
        assert workers.prefill_result is not None
        workers.prefill_result.set_exception(WorkerUnavailableError("prefill worker gone"))
        workers.call.items.put_nowait(_output((8,), 2, FinishReason.LENGTH))
        last = await anext(stream)
        assert last.new_token_ids == (8,) and last.finish_reason is FinishReason.LENGTH
        with pytest.raises(StopAsyncIteration):
            await anext(stream)

    asyncio.run(body())


def test_a_prefill_failure_before_the_first_token_falls_back() -> None:
    async def body() -> None:
        workers = _Workers()
        attempt, router = _attempt(workers)
        stream = attempt.run()
        workers.call.items.put_nowait(RESERVATION)
        pending = asyncio.create_task(anext(stream))
        await _settle()
        assert workers.prefill_result is not None
        workers.prefill_result.set_exception(WorkerUnavailableError("prefill worker gone"))
        with pytest.raises(PrefillLost):
            await pending
        assert workers.call.cancelled  # the reservation is released on the decode worker
        assert not router.registry.get("p").healthy  # routed around until it reports again

    asyncio.run(body())


def test_a_decode_stream_that_ends_early_is_lost_and_a_refusal_is_the_requests_error() -> None:
    async def body(failure: object, expected: type[Exception]) -> None:
        workers = _Workers()
        attempt, router = _attempt(workers, remote=False)
        stream = attempt.run()
        workers.call.items.put_nowait(_output((7,), 1))
        assert (await anext(stream)).new_token_ids == (7,)
        workers.call.items.put_nowait(failure)
        with pytest.raises(expected):
            await anext(stream)
        assert workers.call.cancelled and len(router._pending["d"].decoding) == 0

    asyncio.run(body(_END, DecodeLost))
    asyncio.run(body(WorkerUnavailableError("UNAVAILABLE"), DecodeLost))
    asyncio.run(body(InvalidRequestError("bad", "prompt"), InvalidRequestError))


def test_abort_while_reserving_ends_with_an_abort_chunk_and_cancels_the_calls() -> None:
    async def body() -> None:
        workers = _Workers()
        attempt, _ = _attempt(workers)
        stream = attempt.run()
        pending = asyncio.create_task(anext(stream))
        await _settle()
        attempt.abort()
        chunk = await pending
        assert chunk.finish_reason is FinishReason.ABORT and chunk.new_token_ids == ()
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        assert workers.call.cancelled

    asyncio.run(body())


def test_a_stop_string_ends_the_request_on_the_decode_worker_as_stopped() -> None:
    async def body() -> None:
        workers = _Workers()
        attempt, _ = _attempt(workers, remote=False, stop=("ij",))
        chunks = []
        workers.call.items.put_nowait(_output((7,), 1))  # "h"
        workers.call.items.put_nowait(_output((8,), 2))  # "i"
        workers.call.items.put_nowait(_output((9,), 3))  # "j": "ij" matched
        async for chunk in attempt.run():
            chunks.append(chunk)
        assert "".join(chunk.text for chunk in chunks) == "h"
        assert chunks[-1].finish_reason is FinishReason.STOP and chunks[-1].stop_reason == "ij"
        assert workers.stopped == [("r", True)]

    asyncio.run(body())


def test_an_abort_before_the_first_token_is_a_lost_prefill_not_the_clients_abort() -> None:
    """The decode worker's receive failed (e.g. timed out): it ends the reservation as ABORT.
    The prompt must be computed elsewhere, not reported to the client as aborted."""

    async def body() -> None:
        workers = _Workers()
        attempt, _ = _attempt(workers)
        stream = attempt.run()
        workers.call.items.put_nowait(RESERVATION)
        workers.call.items.put_nowait(_output((), 0, FinishReason.ABORT))
        with pytest.raises(PrefillLost):
            await anext(stream)
        assert workers.call.cancelled

    asyncio.run(body())


def test_a_malformed_decode_message_loses_the_stream_instead_of_hanging() -> None:
    async def body() -> None:
        workers = _Workers()
        attempt, _ = _attempt(workers, remote=False)
        stream = attempt.run()
        workers.call.items.put_nowait(KeyError("unknown finish reason 9"))
        with pytest.raises(DecodeLost):
            await asyncio.wait_for(anext(stream), 5)

    asyncio.run(body())


def test_closing_the_stream_early_cancels_the_calls_and_restores_pending_counts_at_once() -> None:
    async def body() -> None:
        workers = _Workers()
        attempt, router = _attempt(workers)
        stream = attempt.run()
        workers.call.items.put_nowait(RESERVATION)
        workers.call.items.put_nowait(_output((7,), 1))
        assert (await anext(stream)).new_token_ids == (7,)
        await _settle()
        assert len(router._pending["d"].decoding) == 1
        await stream.aclose()  # the client went away mid-stream
        assert workers.call.cancelled
        assert len(router._pending["d"].decoding) == 0
        await _settle()
        assert workers.prefill_cancelled and router._prefill_sent["p:1"] == 0

    asyncio.run(body())


def test_a_workers_streamed_messages_and_prefill_reply_keep_it_from_expiring() -> None:
    """A coordinator relaying thousands of streams may take heartbeats late: the workers whose
    messages it is reading are alive anyway (``WorkerRecord.seen``)."""

    async def body() -> None:
        workers = _Workers()
        attempt, router = _attempt(workers)
        decode, prefill = attempt.route.decode, attempt.route.prefill
        assert prefill is not None
        decode.last_seen = prefill.last_seen = 0.0  # silent since long ago
        decode.last_heartbeat = prefill.last_heartbeat = 0.0
        task = asyncio.create_task(_drain(attempt))
        workers.call.items.put_nowait(RESERVATION)
        await _settle()
        assert decode.last_seen > 0.0 and prefill.last_seen == 0.0
        assert router.registry.expire(now=time.monotonic() + 1.0) == [prefill]  # no sign yet
        router.registry.register(prefill)
        assert workers.prefill_result is not None
        workers.prefill_result.set_result(PrefillDone(num_cached_tokens=0))
        await _settle()
        assert prefill.last_seen > 0.0
        workers.call.items.put_nowait(_output((7,), 1, FinishReason.LENGTH))
        await asyncio.wait_for(task, 5)
        assert router.registry.expire(now=time.monotonic() + 1.0) == []
        # what the load figures' age is told from: heartbeats only
        assert decode.last_heartbeat == prefill.last_heartbeat == 0.0

    asyncio.run(body())


async def _drain(attempt: Attempt) -> None:
    async for _ in attempt.run():
        pass


def test_a_stream_silent_past_its_limit_after_the_first_token_is_stalled() -> None:
    async def body() -> tuple[float, DecodeStalled | None, int]:
        workers = _Workers()
        timeouts = AttemptTimeouts(stall_factor=10.0, stall_floor_s=0.3)
        attempt, _ = _attempt(workers, remote=False, timeouts=timeouts)
        chunks = 0
        stalled = None
        started = time.monotonic()

        async def consume() -> None:
            nonlocal chunks
            async for _ in attempt.run():
                chunks += 1

        task = asyncio.create_task(consume())
        for count in range(1, 4):  # tokens 0.15 s apart: within the limit
            await asyncio.sleep(0.15)
            workers.call.items.put_nowait(_output((count,), count))
        started = time.monotonic()  # then nothing
        try:
            await asyncio.wait_for(task, 5)
        except DecodeStalled as error:
            stalled = error
        return time.monotonic() - started, stalled, chunks

    waited_s, stalled, chunks = asyncio.run(body())
    assert stalled is not None and chunks == 3
    assert 0.3 <= waited_s < 1.5  # the floor: no step times known yet (10 x 0.1 s would be 1 s)


def test_a_lone_decode_workers_silence_waits_for_the_streams_own_limit() -> None:
    """Every decode worker silent together (one here; an overloaded machine, workers hosted
    in one process): moving the request cannot help, so it stalls only past the per-stream
    limit, ``PER_STREAM_STALL_FACTOR`` times the worker's."""

    async def body() -> tuple[float, DecodeStalled | None]:
        workers = _Workers()
        # the limit: 1 x the 0.1 s step assumed before a model is known
        timeouts = AttemptTimeouts(stall_factor=1.0, stall_floor_s=0.1)
        attempt, _ = _attempt(workers, remote=False, timeouts=timeouts, lone_decode=True)

        async def consume() -> None:
            async for _ in attempt.run():
                pass

        task = asyncio.create_task(consume())
        workers.call.items.put_nowait(_output((1,), 1))
        await _settle()
        started = time.monotonic()
        try:
            await asyncio.wait_for(task, 5)
        except DecodeStalled as error:
            return time.monotonic() - started, error
        return time.monotonic() - started, None

    waited_s, stalled = asyncio.run(body())
    assert stalled is not None
    assert PER_STREAM_STALL_FACTOR * 0.1 - 0.1 <= waited_s < 3.0  # not at 0.1 s


def test_no_stall_watch_before_the_first_token_or_when_turned_off() -> None:
    async def body(timeouts: AttemptTimeouts, first_token: bool) -> bool:
        workers = _Workers()
        attempt, _ = _attempt(workers, remote=False, timeouts=timeouts)
        task = asyncio.create_task(_drain(attempt))
        if first_token:
            workers.call.items.put_nowait(_output((1,), 1))
        await asyncio.sleep(0.5)
        finished = task.done()
        workers.call.items.put_nowait(_output((2,), 2, FinishReason.LENGTH))
        await asyncio.wait_for(task, 5)  # raises if it had stalled
        return finished

    quick = AttemptTimeouts(stall_factor=1.0, stall_floor_s=0.1)
    assert not asyncio.run(body(quick, first_token=False))  # a prompt may take long
    assert not asyncio.run(body(dataclasses.replace(quick, stall_factor=0.0), first_token=True))


def test_the_stall_limit_follows_the_workers_reported_step_times() -> None:
    worker = _record("d", Role.DECODE)
    timeouts = AttemptTimeouts(stall_factor=10.0, stall_floor_s=0.2)
    assert stall_limit_s(worker, timeouts) == pytest.approx(1.0)  # 10 x DEFAULT_STEP_S
    cost = StepCost(0.02, 0.001, 0.0, 0.01, 0.001, decode_steps=50, prefill_steps=50)
    worker.load = EngineLoad(100, step_cost=cost, num_running_requests=10, num_running_tokens=1000)
    assert stall_limit_s(worker, timeouts) == pytest.approx(10 * 0.03)  # above the floor
    worker.load = dataclasses.replace(
        worker.load, num_pending_prefill_tokens=5000, prefill_chunk_tokens=256
    )
    assert stall_limit_s(worker, timeouts) == pytest.approx(10 * (0.03 + 0.01 + 0.256))
    assert stall_limit_s(worker, dataclasses.replace(timeouts, stall_floor_s=9.0)) == 9.0


def _pushed_prompt(workers: _Workers) -> tuple[WorkerRecord, asyncio.Task[None]]:
    """A remote-prefill attempt with a 0.3 s stall floor, run until its reservation came (its
    prefill call started): its prefill worker and the task draining it."""
    timeouts = AttemptTimeouts(stall_factor=10.0, stall_floor_s=0.3)
    attempt, _ = _attempt(workers, timeouts=timeouts)
    prefill = attempt.route.prefill
    assert prefill is not None
    task = asyncio.create_task(_drain(attempt))
    workers.call.items.put_nowait(RESERVATION)
    return prefill, task


def test_a_pushed_prompt_without_a_first_token_past_its_limit_is_a_prefill_stall() -> None:
    async def body() -> tuple[float, bool, bool]:
        workers = _Workers()
        prefill, task = _pushed_prompt(workers)  # the prefill call starts, then nothing
        started = time.monotonic()
        stalled = False
        try:
            await asyncio.wait_for(task, 5)
        except PrefillStalled:
            stalled = True
        return time.monotonic() - started, stalled, prefill.healthy

    waited_s, stalled, healthy = asyncio.run(body())
    assert stalled and not healthy  # the prefill worker is reported failed
    assert 1.0 <= waited_s < 2.0  # 10 x the default estimate for 5 tokens: 1.1 s


def test_a_first_token_in_time_hands_the_watch_to_the_decode_phase() -> None:
    async def body() -> None:
        workers = _Workers()
        timeouts = AttemptTimeouts(stall_factor=10.0, stall_floor_s=0.4)
        attempt, _ = _attempt(workers, timeouts=timeouts)
        task = asyncio.create_task(_drain(attempt))
        workers.call.items.put_nowait(RESERVATION)
        await asyncio.sleep(0.3)
        workers.call.items.put_nowait(_output((7,), 1))  # in time
        for count in range(2, 5):  # then tokens 0.3 s apart, each within the decode limit
            await asyncio.sleep(0.3)
            workers.call.items.put_nowait(_output((count,), count))
        workers.call.items.put_nowait(_output((5,), 5, FinishReason.LENGTH))
        await asyncio.wait_for(task, 5)  # raises if either phase had stalled

    asyncio.run(body())


def test_the_prefill_stall_limit_counts_the_prompts_queued_before_it() -> None:
    worker = _record("p", Role.PREFILL)
    timeouts = AttemptTimeouts(stall_factor=10.0, stall_floor_s=0.2)
    assert prefill_stall_limit_s(worker, 100, timeouts) == pytest.approx(10 * (0.1 + 0.2))
    cost = StepCost(0.0, 0.0, 0.0, 0.01, 0.001, decode_steps=0, prefill_steps=50)
    worker.load = EngineLoad(
        100, step_cost=cost, num_pending_prefill_tokens=900, prefill_chunk_tokens=256
    )
    # 1,000 tokens: 4 chunks of at most 256
    assert prefill_stall_limit_s(worker, 100, timeouts) == pytest.approx(10 * (0.04 + 1.0))
    # a crowd's prompts that routing counted ahead of this one, not yet in any report:
    # 2,000 + 100 tokens, 9 chunks
    limit_s = prefill_stall_limit_s(worker, 100, timeouts, queued_tokens=2000)
    assert limit_s == pytest.approx(10 * (0.09 + 2.1))
    # fewer counted than reported: the report stands
    assert prefill_stall_limit_s(worker, 100, timeouts, 300) == pytest.approx(10 * (0.04 + 1.0))


def test_a_first_token_late_after_the_prefill_answered_is_the_decode_workers_stall() -> None:
    """The prefill worker answered (its KV landed) and then no first token comes: the
    silence is the decode worker's. The stall is a decode stall (resume elsewhere) and the
    prefill worker is not reported failed."""

    async def body() -> tuple[BaseException | None, bool]:
        workers = _Workers()
        prefill, task = _pushed_prompt(workers)
        while workers.prefill_result is None:
            await asyncio.sleep(0.01)
        workers.prefill_result.set_result(PrefillDone(num_cached_tokens=0))
        try:
            await asyncio.wait_for(task, 5)
        except (DecodeStalled, PrefillStalled) as error:
            return error, prefill.healthy
        return None, prefill.healthy

    error, prefill_healthy = asyncio.run(body())
    assert isinstance(error, DecodeStalled) and not isinstance(error, PrefillStalled)
    assert prefill_healthy
