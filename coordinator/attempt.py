"""One attempt of a request: its protocol with one decode worker and maybe one prefill worker.

The decode worker's stream is the one source of tokens: it carries every generated token,
the first included (a prefill worker hands its first token to the decode worker with the KV,
never to the coordinator). The attempt feeds them to the request's ``RequestTracker``, which
detokenizes and applies stop strings; every other stop rule is the decode worker's scheduler's.

States (``AttemptState``)::

    RESERVING --Reserved--> PREFILLING --first Decoded--> DECODING --finish--> ENDED
    (local prefill: the attempt starts in DECODING)

Events (typed, matched in ``Attempt.run``), each from one producer task:
- ``Reserved``: the decode worker reserved blocks (remote prefill); the prefill call starts,
  carrying the reservation to the prefill worker as it came (never read here).
- ``Decoded``: a step output from the decode stream (tokens and/or the finish).
- ``DecodeClosed``: the decode stream ended; ``error`` says why when it failed.
- ``Prefilled`` / ``PrefillFailed``: the prefill call's outcome.
- ``AbortRequested``: the client or an operator aborted the request.
- ``FinishedInline`` / ``InlineFailed``: a step output taken inline (below) finished the
  request, or raised.

Inline delivery (``run(inline=...)``, on a multiplexed decode stream): once the first token
came, a step output that arrives while no event waits is processed as it arrives, in the
shared decode call's reader: tracked, detokenized and handed to ``inline`` with no task
switch per stream and step (issue 31: the relay's cost per token). Anything else (the first
token, reservations, errors, outputs behind a waiting event) goes through the events as
above, so the order of a stream's chunks never changes.

Outcomes: the attempt ends normally once the request finished (or was aborted), or raises
``PrefillLost`` (the prefill failed before the first token, or the decode worker gave up
waiting for the KV and aborted the reservation; the flow then prefills on a decode worker),
``DecodeLost`` (the decode worker failed; the flow resumes elsewhere), or the request's own
error (``InvalidRequestError``, ``CapacityError``), which ends the request. A prefill failure
after the first token changes nothing: the KV had landed. Every exit cancels the decode call
and the prefill call, which frees the request's blocks on both workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from splitserve.common.errors import (
    CapacityError,
    InvalidRequestError,
    SplitserveError,
    WorkerCallError,
    WorkerUnavailableError,
)
from splitserve.common.membership import Role
from splitserve.common.output_processor import RequestTracker, StreamChunk
from splitserve.common.request_update import FinishReason, StepOutput
from splitserve.coordinator.registry import WorkerRecord
from splitserve.coordinator.request_record import RequestRecord
from splitserve.coordinator.router import DecodeProgress, Route, Router
from splitserve.coordinator.stall_limits import (
    PER_STREAM_STALL_FACTOR,
    TIMER_SLACK_S,
    AttemptTimeouts,
    prefill_stall_limit_s,
    silence_s,
    stall_limit_s,
)
from splitserve.proto.worker_clients import (
    DecodeCall,
    MultiplexedDecodeCall,
    RelayedReservation,
    WorkerChannels,
)
from splitserve.transfer.reservation import PrefillDone

logger = logging.getLogger(__name__)

InlineSink = Callable[[StreamChunk], None]
"""Takes a stream chunk made inline (``Attempt.run``); must not block."""


class AttemptState(enum.Enum):
    RESERVING = "reserving"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    ENDED = "ended"


@dataclass(frozen=True)
class Reserved:
    reservation: RelayedReservation


@dataclass(frozen=True)
class Decoded:
    output: StepOutput


@dataclass(frozen=True)
class DecodeClosed:
    error: SplitserveError | None
    """None: the stream ended without the request finishing."""


@dataclass(frozen=True)
class Prefilled:
    done: PrefillDone


@dataclass(frozen=True)
class PrefillFailed:
    error: SplitserveError


@dataclass(frozen=True)
class AbortRequested:
    pass


@dataclass(frozen=True)
class FinishedInline:
    """A chunk taken inline finished the request."""


@dataclass(frozen=True)
class InlineFailed:
    error: Exception


@dataclass(frozen=True)
class StreamStalled:
    """Nothing came for ``silent_s``, more than ``limit_s``: in ``PREFILLING`` no first
    token since the prefill call started (``prefill_stall_limit_s``), in ``DECODING`` no
    message since the last one (``stall_limit_s``)."""

    silent_s: float
    limit_s: float
    state: AttemptState
    """The attempt's state when the watch was armed (a stall of an earlier state is stale)."""


AttemptEvent = (
    Reserved
    | Decoded
    | DecodeClosed
    | Prefilled
    | PrefillFailed
    | AbortRequested
    | FinishedInline
    | InlineFailed
    | StreamStalled
)


class PrefillLost(Exception):
    """The prefill failed before the first token; prefill on the decode worker next."""


class DecodeLost(Exception):
    """The decode worker failed; resume the request elsewhere."""


class DecodeStalled(DecodeLost):
    """The decode stream went silent past its stall limit (``StreamStalled``): the worker is
    treated as failed and the request resumes elsewhere."""


class PrefillStalled(PrefillLost):
    """A pushed prompt brought no first token within its stall limit: the prefill worker is
    treated as failed and the prompt is computed on a decode worker."""


class Attempt:
    """Runs ``request`` once on ``route``; iterate ``run()`` for its stream chunks.

    ``prior_output_token_ids`` are the tokens streamed by earlier attempts (the decode worker
    goes on after them: budget, penalties and seeded sampling as if the request had never
    moved); the workers get the request's params without its stop strings (those are the
    tracker's)."""

    def __init__(
        self,
        request: RequestRecord,
        tracker: RequestTracker,
        route: Route,
        router: Router,
        channels: WorkerChannels,
        timeouts: AttemptTimeouts,
        prior_output_token_ids: Sequence[int] = (),
    ) -> None:
        self.tracker = tracker
        self._traceparent = request.traceparent
        self.route = route
        self.state = AttemptState.RESERVING if route.prefill else AttemptState.DECODING
        self.num_cached_tokens = 0
        self.stage_seconds: list[tuple[str, float]] = []
        """(stage, seconds) as they completed: reserve, prefill or local_prefill."""
        self.first_token_s: float | None = None
        """Seconds from the attempt's start to its first token, once it came."""
        self._started = self._stage_start = time.monotonic()
        """When the attempt started, and when its current stage did."""
        self._prompt = list(request.prompt_token_ids)
        self._prior_output = list(prior_output_token_ids)
        self._params = dataclasses.replace(
            request.params,
            stop=(),
            # a resumed request's prompt logprobs came with its first token, before
            prompt_logprobs=None if self._prior_output else request.params.prompt_logprobs,
        )
        self._stop_strings = request.params.stop
        self._router = router
        self._channels = channels
        self._timeouts = timeouts
        self._events: asyncio.Queue[AttemptEvent] = asyncio.Queue()
        self._held_event: AttemptEvent | None = None
        """Taken from ``_events`` while merging decoded outputs, not yet handled."""
        self._progress = DecodeProgress(
            max_tokens=request.tokens_left(len(self._prior_output)), tpot_s=route.slo.tpot_s
        )
        """What the router's placement sees of this request while it decodes."""
        self._local_prompt = contextlib.ExitStack()
        """Counts a prompt the decode worker computes as queued there until its first token."""
        self._last_message_at = self._started
        """When the decode stream last brought a message."""
        self._prefill_started_at: float | None = None
        """When the prefill call started (remote prefill only)."""
        self._prefill_answered_at: float | None = None
        """When the prefill call returned while the first token had not come: from then on
        a silence is the decode worker's."""
        self._stall_watch: asyncio.TimerHandle | None = None
        """The pending stall check (``_watch_for_stalls``): from the prefill call's start
        while a prefill worker computes the prompt, and from the first token on."""
        self._inline: InlineSink | None = None
        """Where chunks taken inline go while the attempt runs (None: none are)."""

    def abort(self) -> None:
        """End the attempt as aborted; its stream gets a final ABORT chunk."""
        self._events.put_nowait(AbortRequested())

    async def run(self, inline: InlineSink | None = None) -> AsyncIterator[StreamChunk]:
        """The attempt's chunks; with ``inline``, those taken inline go there instead (see
        the module)."""
        decode = self.route.decode
        call = self._channels.decode(decode.address).generate(
            self.tracker.request_id,
            self._prompt,
            self._params,
            remote_prefill=self.route.prefill is not None,
            timeout_s=self._timeouts.request_s,
            prior_output_token_ids=self._prior_output,
            traceparent=self._traceparent,
        )
        tasks = [asyncio.create_task(self._read_decode(call))]
        if inline is not None and isinstance(call, MultiplexedDecodeCall):
            self._inline = inline
            call.listen(self._take_inline)
        self._started = self._stage_start = time.monotonic()
        if self.route.prefill is None:  # the decode worker computes the prompt itself
            computed = len(self._prompt) + len(self._prior_output)  # a resume recomputes both
            self._local_prompt.enter_context(self._router.prefilling(decode, computed))
        with self._router.decoding(decode, self._progress), self._local_prompt:
            try:
                while self.state is not AttemptState.ENDED:
                    event = await self._next_event()
                    chunk = self._handle(event, tasks)
                    if chunk is not None:
                        yield chunk
                    finished = isinstance(event, Decoded) and self.tracker.finished
                    if finished or isinstance(event, FinishedInline):
                        self._router.finished(
                            decode,
                            self._prompt + self.tracker.token_ids,
                            self._params.cache_salt,
                            self._params.adapter,
                        )
                        await self._end_on_worker(decode)
            finally:
                self._inline = None
                if self._stall_watch is not None:
                    self._stall_watch.cancel()
                for task in tasks:
                    task.cancel()
                call.cancel()

    def _handle(self, event: AttemptEvent, tasks: list[asyncio.Task[None]]) -> StreamChunk | None:
        """Apply one event: the chunk to stream, if it makes one; raises how the attempt
        ends when it does (module docstring: outcomes). A finishing chunk is ended on the
        worker by ``run``."""
        match event:
            case Reserved(reservation):
                self._stage_start = self._stage("reserve", self._started)
                self.state = AttemptState.PREFILLING
                tasks.append(asyncio.create_task(self._prefill(reservation)))
                self._prefill_started_at = time.monotonic()
                self._watch_for_stalls()
            case Prefilled(done):
                self.num_cached_tokens = done.num_cached_tokens
                if self.route.prefill is not None:
                    self._router.report_success(self.route.prefill)
                if self.state is AttemptState.PREFILLING:  # the rest is decode's
                    self._prefill_answered_at = time.monotonic()
                    self._watch_for_stalls()
            case PrefillFailed(error) if self.state is AttemptState.PREFILLING:
                logger.warning("%s: prefill failed (%s)", self._label, error)
                raise PrefillLost(str(error))
            case Decoded(output) if self._gave_up_on_kv(output):
                logger.warning("%s: the decode worker gave up the KV", self._label)
                raise PrefillLost("the decode worker aborted the reservation")
            case Decoded(output):
                return self._decoded(output, self._stage_start)
            case InlineFailed(error):
                raise error
            case DecodeClosed(error=InvalidRequestError() | CapacityError() as error):
                raise error
            case DecodeClosed(error):
                logger.warning("%s: decode stream lost (%s)", self._label, error)
                raise DecodeLost(str(error or "the stream ended early"))
            case AbortRequested():
                self.state = AttemptState.ENDED
                return self.tracker.abort()
            case StreamStalled() if event.state is self.state:  # else: armed in an earlier
                self._stalled(event)  # state, whose limit no longer applies
        # PrefillFailed after the first token: the KV had landed, decoding goes on;
        # FinishedInline: ``run`` ends it on the worker
        return None

    def _stalled(self, stall: StreamStalled) -> NoReturn:
        """Raise the stall's outcome: a pushed prompt without its first token is computed
        on a decode worker (its prefill worker reported failed); a silent decode stream
        resumes elsewhere."""
        prefill = self.route.prefill
        if prefill and self.state is AttemptState.PREFILLING and self._prefill_answered_at is None:
            logger.warning(
                "%s: stalled while %s computed the prompt: no first token for %.1f s (limit "
                "%.1f s from its step times); computing it on a decode worker",
                self._label,
                prefill.worker_id,
                stall.silent_s,
                stall.limit_s,
            )
            self._router.report_failure(prefill)
            raise PrefillStalled(f"no first token for {stall.silent_s:.1f} s")
        logger.warning(
            "%s: stalled while decoding: no token for %.1f s (limit %.1f s from the worker's "
            "step times); resuming elsewhere",
            self._label,
            stall.silent_s,
            stall.limit_s,
        )
        raise DecodeStalled(f"no token for {stall.silent_s:.1f} s")

    async def _next_event(self) -> AttemptEvent:
        """The next event, in order; ``Decoded`` events that queued up while this attempt
        was busy come as one (``StepOutput.followed_by``), so a coordinator that falls behind
        catches up with one response per request, not one per step it missed."""
        event = self._held_event if self._held_event is not None else await self._events.get()
        self._held_event = None
        if not isinstance(event, Decoded):
            return event
        output = event.output
        while output.update.finish_reason is None and not self._events.empty():
            later = self._events.get_nowait()
            if not isinstance(later, Decoded):
                self._held_event = later
                break
            output = output.followed_by(later.output)
        return Decoded(output) if output is not event.output else event

    @property
    def _label(self) -> str:
        return f"{self.tracker.request_id} on {self.route.decode.worker_id}"

    def _stage(self, name: str, since: float) -> float:
        now = time.monotonic()
        self.stage_seconds.append((name, now - since))
        return now

    def _gave_up_on_kv(self, output: StepOutput) -> bool:
        """An ABORT before the first token of a pushed prompt: the decode worker's receive
        failed (the KV never landed) and it ended the request; the prompt must be computed
        elsewhere, not reported to the client as aborted."""
        update = output.update
        return (
            self.state is AttemptState.PREFILLING
            and update.finish_reason is FinishReason.ABORT
            and not update.new_token_ids
        )

    def _decoded(self, output: StepOutput, stage_start: float) -> StreamChunk:
        if self.state is not AttemptState.DECODING:  # the first token: the KV landed
            self._stage("prefill", stage_start)
            self.state = AttemptState.DECODING
        elif self.route.prefill is None and not self.stage_seconds:
            self._stage("local_prefill", stage_start)
        if self.first_token_s is None:
            self._local_prompt.close()
            self._progress.first_token_at = time.monotonic()
            self.first_token_s = self._progress.first_token_at - self._started
            self._router.report_success(self.route.decode)
            self._watch_for_stalls()
        self._progress.num_tokens += len(output.update.new_token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, output.update.num_cached_tokens)
        return self.tracker.process(output.update, output.logprobs, output.prompt_logprobs)

    def _take_inline(self, output: StepOutput) -> bool:
        """The decode call's listener: process ``output`` now and hand its chunk to the inline
        sink, if it may overtake nothing (module docstring); False: it goes as an event."""
        inline = self._inline
        if (
            inline is None
            or self.state is not AttemptState.DECODING
            or self.first_token_s is None
            or self._held_event is not None
            or not self._events.empty()
        ):
            return False
        decode = self.route.decode
        decode.seen()
        self._last_message_at = decode.last_seen
        try:  # past the first token, _decoded records no stage: its stage start is unused
            inline(self._decoded(output, self._started))
        except Exception as error:  # a bug: end this attempt with it, as the events would
            self._inline = None
            self._events.put_nowait(InlineFailed(error))
            return True
        if self.tracker.finished:
            self._inline = None
            self._events.put_nowait(FinishedInline())
        return True

    def _watch_for_stalls(self) -> None:
        """Arm the stall check for the attempt's state (``PREFILLING``: since the prefill
        call started, or, once it answered without a first token, since then against the
        decode worker's limit; ``DECODING``: since the stream's last message), replacing any
        armed before: one timer per limit, not one per message (a message only stores its
        time, ``_read_decode``)."""
        if self._stall_watch is not None:
            self._stall_watch.cancel()
            self._stall_watch = None
        if self._timeouts.stall_factor <= 0 or (watched := self._silence_watched()) is None:
            return
        since, worker = watched
        if worker is self.route.prefill:
            prompt, queued = len(self._prompt), self.route.queued_prefill_tokens
            limit_s = prefill_stall_limit_s(worker, prompt, self._timeouts, queued)
        else:
            limit_s = stall_limit_s(worker, self._timeouts)
        self._arm_stall_check(limit_s, max(0.0, since + limit_s - time.monotonic()))

    def _silence_watched(self) -> tuple[float, WorkerRecord] | None:
        """Since when, and whose, the current state's silence is: the prefill worker's from
        the prefill call's start until it answers; then (the KV landed) the decode
        worker's from that answer until the first token; the decode worker's from the
        stream's last message once decoding. None where no silence is watched."""
        if self.state is AttemptState.PREFILLING and self._prefill_answered_at is not None:
            return self._prefill_answered_at, self.route.decode
        if self.state is AttemptState.PREFILLING and self.route.prefill is not None:
            assert self._prefill_started_at is not None  # set with the state
            return self._prefill_started_at, self.route.prefill
        if self.state is AttemptState.DECODING:
            return self._last_message_at, self.route.decode
        return None

    def _arm_stall_check(self, limit_s: float, due_in_s: float) -> None:
        self._stall_watch = asyncio.get_running_loop().call_later(
            due_in_s, self._check_stall, limit_s, self.state
        )

    def _check_stall(self, limit_s: float, state: AttemptState) -> None:
        """A stall is silence past ``limit_s`` that is the worker's, not this process's:
        time the coordinator's own event loop ran late is left out (``common/loop_lag.py``:
        a coordinator too busy to read is not a stalled worker), and the worker counts as
        heard from when anything of it reached this coordinator (``WorkerRecord.last_seen``:
        a heartbeat, another stream's message, a reply); a request on a worker heard from
        stalls only past ``PER_STREAM_STALL_FACTOR`` times its limit. A decode worker's
        silence is its own only while another decode worker was heard from within the limit
        (``_heard_elsewhere``): when all went quiet together (an overloaded machine starving
        their processes, workers hosted in one process), moving the request cannot help, and
        only the per-stream limit applies. Not yet due: checked again when it would be."""
        self._stall_watch = None
        if state is not self.state:
            return  # the attempt moved on (its new state armed its own watch)
        now = time.monotonic()
        stalled_after_s = limit_s
        watched = self._silence_watched()
        assert watched is not None  # the state it was armed in, which watches
        since, worker = watched
        silent_s = silence_s(max(since, worker.last_seen), now)
        stream_s = silence_s(since, now)
        stream_limit_s = PER_STREAM_STALL_FACTOR * limit_s
        remaining_s = limit_s - silent_s
        if (
            remaining_s <= TIMER_SLACK_S
            and worker is self.route.decode
            and not self._heard_elsewhere(worker, now - limit_s)
        ):
            remaining_s = limit_s  # all quiet together: look again a limit later
        if stream_limit_s - stream_s < remaining_s:
            silent_s, stalled_after_s = stream_s, stream_limit_s
            remaining_s = stream_limit_s - stream_s
        if remaining_s <= TIMER_SLACK_S:
            self._events.put_nowait(StreamStalled(silent_s, stalled_after_s, state))
        else:
            self._arm_stall_check(limit_s, remaining_s)

    def _heard_elsewhere(self, worker: WorkerRecord, since: float) -> bool:
        """Whether a decode worker other than ``worker`` reached this coordinator after
        ``since`` (``time.monotonic()``)."""
        return any(
            other.worker_id != worker.worker_id and other.last_seen > since
            for other in self._router.registry.workers(Role.DECODE, healthy_only=False)
        )

    async def _end_on_worker(self, decode: WorkerRecord) -> None:
        """The request finished; a stop string matched here must end it there too (as STOP)."""
        self.state = AttemptState.ENDED
        if self.tracker.stop_reason not in self._stop_strings:
            return  # the decode worker finished it itself
        with contextlib.suppress(SplitserveError):
            await self._channels.decode(decode.address).stop(
                self.tracker.request_id, as_stopped=True, timeout_s=self._timeouts.stop_s
            )

    async def _read_decode(self, call: DecodeCall | MultiplexedDecodeCall) -> None:
        """Producer of the decode stream's events; always ends with one ``DecodeClosed``.
        Each message is also a sign of life of its worker (``WorkerRecord.seen``)."""
        decode = self.route.decode
        try:
            async for item in call:
                decode.seen()
                self._last_message_at = decode.last_seen
                event = Reserved(item) if isinstance(item, RelayedReservation) else Decoded(item)
                self._events.put_nowait(event)
        except SplitserveError as error:
            self._events.put_nowait(DecodeClosed(error))
            return
        except Exception as error:  # a bug or a malformed message: the worker's stream is lost
            logger.exception("%s: reading the decode stream failed", self._label)
            self._events.put_nowait(DecodeClosed(WorkerCallError(repr(error))))
            return
        self._events.put_nowait(DecodeClosed(None))

    async def _prefill(self, reservation: RelayedReservation) -> None:
        """Producer of the prefill call's one event, ``Prefilled`` or ``PrefillFailed``."""
        worker = self.route.prefill
        assert worker is not None
        client = self._channels.prefill(worker.address)
        try:
            with self._router.prefilling(worker, len(self._prompt)):
                done = await client.prefill(
                    self.tracker.request_id,
                    self._prompt,
                    self._params,
                    reservation,
                    timeout_s=self._timeouts.prefill_s,
                    traceparent=self._traceparent,
                )
        except SplitserveError as error:
            if isinstance(error, WorkerUnavailableError):
                self._router.report_failure(worker)
            self._events.put_nowait(PrefillFailed(error))
            return
        except Exception as error:  # a bug or a malformed reply: this prefill is lost
            logger.exception("%s: the prefill call failed", self._label)
            self._events.put_nowait(PrefillFailed(WorkerCallError(repr(error))))
            return
        worker.seen()
        self._events.put_nowait(Prefilled(done))
