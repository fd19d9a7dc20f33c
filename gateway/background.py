"""The Responses API's background responses (``background: true``): run by the gateway that
got the request, detached from it, and put in the response store as they go, so that any
gateway of the cluster can answer for them.

Contract:
- A background response is stored (``background`` with ``store: false``, or on a gateway
  storing nothing, is a 400 naming ``background``). Its POST is answered at once: the response
  with ``status: queued`` (its record put first, so a GET on any gateway finds it) or, with
  ``stream: true``, its events as they come (``response.created`` and ``response.queued``,
  ``response.in_progress`` when its first token comes, then a foreground stream's). The
  client going away cancels nothing.
- The run folds its stream as a foreground response does. Its record is put when it starts
  (``in_progress``), while it runs and once it ended (completed, incomplete, failed with the
  error no HTTP status could carry, or cancelled), before its last events go out. Puts of one
  run never overtake each other. Every ``HEARTBEAT_S`` it shows it lives: by putting its
  record, or, where the record is large, by a small sign of life beside it
  (``StoredResponses.put_alive``), the record then put at most once per its size over
  ``SNAPSHOT_BYTES_PER_S`` seconds: a store shared by many running responses (etcd, whose
  history keeps every write until compacted) is written at a bounded rate, not a long
  stream's whole record every 5 s.
- ``GET /v1/responses/{id}``: on the gateway running it, the response as it is now;
  elsewhere its last record. A record still running whose heartbeat is older than
  ``STALE_S`` is answered ``failed`` (``code: gateway_stopped``): the gateway that ran it
  stopped; send the request again.
- ``POST /v1/responses/{id}/cancel``: on the gateway running it, its streams are closed (the
  coordinator aborts them) and it ends ``cancelled``; elsewhere a cancel mark is put beside
  its record, which the gateway running it reads every ``CANCEL_POLL_S``. The answer is the
  response once ended (after at most ``CANCEL_WAIT_S``; else as it is then). An ended
  background response is answered as it is; a response not run in the background is a 400.
- A response created with ``stream: true`` keeps its events in its record:
  ``GET /v1/responses/{id}?stream=true&starting_after=N`` sends those after sequence number N
  and then the rest as they come (on the gateway running it, at once; elsewhere as its
  record's puts bring them); on another response ``stream`` is a 400.
- A response the cluster refuses for now (RESOURCE_EXHAUSTED before its first token: the
  coordinator's in-flight limit, a tenant's share) stays ``queued`` and is sent again after
  the refusal's ``retry-after-ms`` or a back-off (``QUEUED_BACKOFF_S`` doubling to
  ``QUEUED_BACKOFF_MAX_S``), as often as it takes, counted in
  ``splitserve_background_requeued_total``; ``splitserve_background_responses`` is how many
  this gateway runs.
- A draining gateway lets its runs end for up to its drain time, then cancels the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import grpc
from opentelemetry.trace import Span
from prometheus_client import CollectorRegistry, Counter, Gauge

from splitserve.client import Chunk, ClientError, Finish, Usage
from splitserve.common.metrics import RequestMetrics, RequestTimer
from splitserve.common.tracing import NO_SPAN
from splitserve.gateway.choices import Choices
from splitserve.gateway.errors import ApiError, from_client_error, invalid
from splitserve.gateway.reply import record_item
from splitserve.gateway.response_turn import ResponseTurn
from splitserve.gateway.stored_responses import StoredResponse, StoredResponses

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0
"""How often a running background response shows it lives (module docstring)."""
SNAPSHOT_BYTES_PER_S = 16 << 10
"""Bytes a second a running background response's record puts write at most, past its first
put and its last: a record of up to 80 KiB is put every ``HEARTBEAT_S``, one of 1 MiB every
64 s (its sign of life every ``HEARTBEAT_S`` meanwhile)."""
STALE_S = 30.0
"""A running record not put again for this long belongs to a gateway that stopped."""
CANCEL_POLL_S = 1.0
"""How often the gateway running a background response looks for a cancel mark."""
CANCEL_WAIT_S = 10.0
"""How long a cancel waits for the response to end before answering it as it is."""
QUEUED_BACKOFF_S = 0.25
QUEUED_BACKOFF_MAX_S = 5.0
"""A background response the cluster refuses for now (overloaded) stays queued and is sent
again after this back-off (or the cluster's ``retry-after-ms``)."""
FOLLOW_POLL_S = 0.5
"""How often a stream followed from another gateway's record reads it again."""

Item = tuple[int, Chunk | Finish]


def _queued_wait_s(run: BackgroundRun, error: ClientError, waits: int) -> float | None:
    """How long ``run`` waits before it is sent again, where ``error`` is the cluster's
    admission refusing it before it started (RESOURCE_EXHAUSTED: its ``retry-after-ms``,
    else a back-off from ``QUEUED_BACKOFF_S`` doubling to ``QUEUED_BACKOFF_MAX_S``); None
    where it fails."""
    refused = error.code is grpc.StatusCode.RESOURCE_EXHAUSTED and not run.started
    if not refused or run.closing or "larger than max" in error.message:
        return None
    return error.retry_after_s or min(QUEUED_BACKOFF_MAX_S, QUEUED_BACKOFF_S * 2**waits)


def stale(stored: StoredResponse) -> bool:
    """Whether ``stored`` is a running record whose gateway stopped (module docstring)."""
    return stored.running and time.time() - stored.updated_at > STALE_S


def answered(stored: StoredResponse) -> dict[str, Any]:
    """``stored``'s response as answered: ``failed`` where it is ``stale``."""
    if not stale(stored):
        return stored.response
    error = {
        "code": "gateway_stopped",
        "message": "the gateway running this background response stopped before it ended; "
        "send the request again",
    }
    return {**stored.response, "status": "failed", "error": error}


class BackgroundRun:
    """One background response this gateway runs. ``events``: where it keeps its events,
    every event of its stream so far, in sequence order (``events[i]["sequence_number"] ==
    i``); else none."""

    def __init__(self, turn: ResponseTurn, keeps_events: bool) -> None:
        """``turn``: its request's response and what it keeps (the record's response and
        events are this run's); ``keeps_events``: created with ``stream: true``, so its
        record keeps its events."""
        self.turn = turn
        self.builder = turn.builder
        self.response_id = turn.builder.response_id
        self.tenant = turn.tenant
        self.keeps_events = keeps_events
        self.events: list[dict[str, Any]] = []
        self.started = False
        """Whether its first item came (until then it is ``queued``)."""
        self.closing = False
        """Whether it is ending (a cancel then changes nothing)."""
        self.ended = asyncio.Event()
        self.put_lock = asyncio.Lock()
        """Held across each put of its record (their order is the runs')."""
        self.record_bytes = 0
        """The size of its record as last put."""
        self.task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    def snapshot(self) -> dict[str, Any]:
        """The response as it is now."""
        whole = self.builder.whole()
        if not self.started and whole["status"] == "in_progress":
            whole["status"] = "queued"
        return whole

    def record(self) -> StoredResponse:
        """Its record as it is now."""
        events = list(self.events) if self.keeps_events else None
        return dataclasses.replace(self.turn.record(self.snapshot()), events=events)

    def add(self, events: list[dict[str, Any]], wake: bool = True) -> None:
        """Append ``events`` (kept only where it keeps its events: nothing follows the
        others); ``wake``: send them to the streams following it now."""
        if self.keeps_events:
            self.events += events
        if wake:
            self.wake()

    def wake(self) -> None:
        woken, self._wake = self._wake, asyncio.Event()
        woken.set()

    async def follow(self, after: int) -> AsyncIterator[list[dict[str, Any]]]:
        """Its events numbered above ``after``, then those that come, until it ended."""
        position = max(after + 1, 0)
        while True:
            woken = self._wake
            if position < len(self.events):
                batch, position = self.events[position:], len(self.events)
                yield batch
            elif self.ended.is_set():
                return
            else:
                await woken.wait()

    def cancel(self) -> None:
        """Close its streams (the run then ends ``cancelled``)."""
        if self.task is not None and not self.closing:
            self.closing = True
            self.task.cancel()


class BackgroundRuns:
    """The background responses this gateway runs, over its stored responses."""

    def __init__(self, stored: StoredResponses, registry: CollectorRegistry | None = None) -> None:
        self.stored = stored
        self.runs: dict[str, BackgroundRun] = {}
        self._watchers: set[asyncio.Task[None]] = set()
        self._requeued: Counter | None = None
        if registry is not None:
            Gauge(
                "splitserve_background_responses",
                "Background responses this gateway runs now (queued or in progress; "
                "gateway/background.py).",
                registry=registry,
            ).set_function(lambda: len(self.runs))
            self._requeued = Counter(
                "splitserve_background_requeued",
                "Times a background response the cluster refused for now (overloaded) was "
                "kept queued and sent again.",
                registry=registry,
            )

    def local(self, response_id: str, tenant: str) -> BackgroundRun | None:
        """The run of ``response_id`` here, if this gateway runs it for ``tenant``."""
        run = self.runs.get(response_id)
        return run if run is not None and run.tenant == tenant else None

    async def start(
        self,
        turn: ResponseTurn,
        open_events: Callable[[], AsyncGenerator[Item, None]],
        choices: Choices,
        metrics: RequestMetrics,
        keeps_events: bool,
        span: Span = NO_SPAN,
    ) -> BackgroundRun:
        """Put the queued response and start running it (``open_events``: its merged
        streams, made again each time it is sent; nothing is sent before the run reads
        them); once it ended, its turn is added to its conversation, if any
        (``ResponseTurn.add_to_conversation``)."""
        run = BackgroundRun(turn, keeps_events)
        run.add(turn.builder.queued_events())
        await self.stored.put(run.record())
        self.runs[run.response_id] = run
        run.task = asyncio.create_task(self._run(run, open_events, choices, metrics, span))
        watcher = asyncio.create_task(self._watch(run))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        return run

    async def _run(
        self,
        run: BackgroundRun,
        open_events: Callable[[], AsyncGenerator[Item, None]],
        choices: Choices,
        metrics: RequestMetrics,
        span: Span,
    ) -> None:
        timer = metrics.start(span)
        waits = 0
        while True:
            events = open_events()
            wait_s = None
            try:
                await self._fold(run, events, choices, timer)
            except asyncio.CancelledError:
                self._cancelled(run, choices, timer)
            except ClientError as error:
                wait_s = _queued_wait_s(run, error, waits)
                if wait_s is None:
                    run.closing = True
                    timer.finish("error")
                    run.add(run.builder.fail(from_client_error(error)), wake=False)
            except Exception as error:  # a bug: the response fails, the gateway goes on
                log.exception("background response %s failed", run.response_id)
                run.closing = True
                timer.finish("error")
                failure = ApiError(500, f"the gateway failed: {error}", type="server_error")
                run.add(run.builder.fail(failure), wake=False)
            finally:
                await events.aclose()
            if wait_s is None:
                break
            waits += 1
            if self._requeued is not None:
                self._requeued.inc()
            try:  # still queued: the cluster admits it later
                await asyncio.sleep(wait_s)
            except asyncio.CancelledError:
                self._cancelled(run, choices, timer)
                break
        await self._put(run, last=True)
        run.wake()
        self.runs.pop(run.response_id, None)
        await run.turn.add_to_conversation()

    async def _fold(
        self,
        run: BackgroundRun,
        events: AsyncGenerator[Item, None],
        choices: Choices,
        timer: RequestTimer,
    ) -> None:
        """Fold ``events`` into ``run`` until every choice finished (its last events kept
        back for after its last put)."""
        async for index, item in events:
            if not run.started:
                run.started = True
                run.add(run.builder.in_progress_events())
                await self._put(run)
            bodies = choices.add(index, item)
            record_item(timer, choices, item)
            if choices.all_finished:
                run.closing = True
            run.add(bodies, wake=not choices.all_finished)
            if choices.all_finished:
                return
        raise ClientError(grpc.StatusCode.INTERNAL, "the stream ended without its end")

    @staticmethod
    def _cancelled(run: BackgroundRun, choices: Choices, timer: RequestTimer) -> None:
        """End ``run`` ``cancelled`` (its task's cancel taken back: the run goes on to its
        last put)."""
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        usage = run.builder.usage or Usage(0, 0, 0)
        finish = Finish(run.response_id, "abort", None, usage)
        run.add(choices.add(0, finish), wake=False)
        record_item(timer, choices, finish)

    async def _put(self, run: BackgroundRun, last: bool = False) -> None:
        """Put ``run``'s record (none after its last: a late heartbeat overtakes nothing)."""
        async with run.put_lock:
            if run.ended.is_set():
                return
            run.record_bytes = await self.stored.put(run.record())
            if last:
                run.ended.set()

    async def _watch(self, run: BackgroundRun) -> None:
        """Until ``run`` ended: its heartbeat (module docstring), and the cancel mark another
        gateway may put."""
        last_put = last_beat = time.monotonic()
        while not run.ended.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(run.ended.wait(), CANCEL_POLL_S)
            if run.ended.is_set():
                return
            if await self.stored.cancel_asked(run.response_id):
                run.cancel()
            now = time.monotonic()
            if now - last_beat < HEARTBEAT_S:
                continue
            if now - last_put >= max(HEARTBEAT_S, run.record_bytes / SNAPSHOT_BYTES_PER_S):
                await self._put(run)
                last_put = time.monotonic()
            else:
                await self.stored.put_alive(run.response_id)
            last_beat = time.monotonic()

    async def cancel(self, response_id: str, tenant: str) -> dict[str, Any]:
        """Cancel ``tenant``'s background response ``response_id`` (module docstring); the
        response once ended."""
        run = self.local(response_id, tenant)
        if run is not None:
            run.cancel()
            await run.ended.wait()
            return run.snapshot()
        found = await self.stored.get(response_id, tenant)
        if not found.response.get("background"):
            raise invalid("only a response created with background: true can be cancelled")
        if not found.running or stale(found):
            return answered(found)
        await self.stored.ask_cancel(response_id)
        deadline = time.monotonic() + CANCEL_WAIT_S
        while found.running and time.monotonic() < deadline:
            await asyncio.sleep(FOLLOW_POLL_S / 2)
            found = await self.stored.get(response_id, tenant)
        return answered(found)

    async def follow(
        self, response_id: str, tenant: str, after: int
    ) -> AsyncIterator[list[dict[str, Any]]]:
        """The events of ``tenant``'s background response ``response_id`` numbered above
        ``after``, then those that come until it ends (module docstring). Raises ``ApiError``
        before its first batch: 404 as ``get``, 400 for a response that kept no events."""
        run = self.local(response_id, tenant)
        if run is not None and run.keeps_events:
            return run.follow(after)
        found = await self.stored.get(response_id, tenant)
        if found.events is None:
            raise invalid(
                "only a background response created with stream: true can be streamed",
                "stream",
            )
        return self._follow_stored(found, tenant, after)

    async def _follow_stored(
        self, found: StoredResponse, tenant: str, after: int
    ) -> AsyncIterator[list[dict[str, Any]]]:
        position = max(after + 1, 0)
        while True:
            assert found.events is not None
            if position < len(found.events):
                yield found.events[position:]
                position = len(found.events)
            if not found.running:
                return
            if stale(found):
                error = answered(found)["error"]
                yield [{"type": "error", "sequence_number": position, **error, "param": None}]
                return
            await asyncio.sleep(FOLLOW_POLL_S)
            found = await self.stored.get(found.response["id"], tenant)

    async def drain(self, timeout_s: float) -> None:
        """Let the runs end for up to ``timeout_s``, then cancel the rest (their records say
        so) and wait for them."""
        running = list(self.runs.values())
        if not running:
            return
        ended = [asyncio.create_task(run.ended.wait()) for run in running]
        _, pending = await asyncio.wait(ended, timeout=timeout_s)
        for task in pending:
            task.cancel()
        for run in running:
            run.cancel()
        await asyncio.gather(*(run.ended.wait() for run in running))
