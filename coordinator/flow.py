"""One request across its attempts: routing, retry and resume (the coordinator's state machine).

States (``FlowState``)::

    ADMITTED --route--> RUNNING --finish / abort--> FINISHED
                           |  ^
          worker failed    v  |  next attempt
                         RESUMING --no worker / attempts used up--> FAILED

Each attempt (``attempt.py``) runs the request on one route. When one fails the client still
sees one uninterrupted stream:
- ``PrefillLost`` (prefill worker gone, transfer failed, layouts incompatible): the next
  attempt prefills on a decode worker;
- ``DecodeLost`` (decode worker gone): the worker is marked failed and the request resumes on
  another decode worker from the prompt and the tokens already streamed, which that worker
  takes as the request's earlier output (budget, penalties, seeded sampling go on exactly);
- every decode worker failed it (this coordinator cut off from them all, say): it waits up to
  ``FlowConfig.worker_return_wait_s`` for one to be routable again (a healed partition, a
  restarted worker) and resumes there, before it fails with ``WorkerUnavailableError``;
- the request's own errors (``InvalidRequestError``, ``CapacityError``) end it with that error.
``RequestTracker`` keeps what was streamed across attempts, so no token is doubled or lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from splitserve.common.detokenizer import TokenDecoder
from splitserve.common.errors import InvalidRequestError, WorkerUnavailableError
from splitserve.common.output_processor import RequestTracker, StreamChunk
from splitserve.common.request_update import RequestUpdate
from splitserve.common.sampling_params import SamplingParams
from splitserve.coordinator.attempt import (
    Attempt,
    AttemptTimeouts,
    DecodeLost,
    DecodeStalled,
    InlineSink,
    PrefillLost,
    PrefillStalled,
)
from splitserve.coordinator.placement import Placement
from splitserve.coordinator.request_record import RequestRecord
from splitserve.coordinator.router import Router
from splitserve.proto.worker_clients import WorkerChannels


@dataclass(frozen=True)
class PlacementOutcome:
    """A request's placement and what came of it."""

    placement: Placement
    first_token_s: float | None
    """Attempt start -> first token; None when the attempt produced none."""


class FlowState(enum.Enum):
    ADMITTED = "admitted"
    RUNNING = "running"
    RESUMING = "resuming"
    FINISHED = "finished"
    FAILED = "failed"


@dataclass(frozen=True)
class FlowConfig:
    max_attempts: int = 3
    timeouts: AttemptTimeouts = AttemptTimeouts()
    worker_return_wait_s: float = 15.0
    """When every decode worker has failed a request (this coordinator cut off from them, a
    partition that may heal), how long it waits for one to take the request again before the
    request fails (``RequestFlow.run``)."""


WORKER_RETURN_POLL_S = 0.25


class RequestFlow:
    """Runs one request; iterate ``run()`` for its stream chunks."""

    def __init__(
        self,
        request: RequestRecord,
        decoder: TokenDecoder,
        router: Router,
        channels: WorkerChannels,
        config: FlowConfig,
    ) -> None:
        """``request``: the request's record (``request_record.py``), which every attempt
        routes and runs by: its targets place its prompt (its TTFT target counts from its
        arrival, so placement counts the wait since: admission's queue), its span is what
        every attempt's worker spans join, its session what every attempt routes by."""
        self.request = request
        self.state = FlowState.ADMITTED
        self.tracker = RequestTracker(
            request.request_id, request.prompt_token_ids, request.params, decoder
        )
        self._num_cached_tokens = 0  # of attempts that ended
        self._router = router
        self._channels = channels
        self._config = config
        self._attempt: Attempt | None = None
        self._aborted = False
        self.stage_seconds: list[tuple[str, float]] = []
        """(stage, seconds) of every attempt: reserve (decode worker reserved blocks),
        prefill (reservation -> first token, KV pushed), local_prefill (no prefill worker)."""
        self.placement: PlacementOutcome | None = None
        """Where the first attempt computed the prompt, and how long its first token took."""
        self.recoveries: list[str] = []
        """prefill_fallback / decode_resume, each time a worker failed this request;
        coordinator_continuation once when it continues a stream another coordinator broke
        (``replay``)."""
        self.stalls: list[tuple[str, str]] = []
        """(role, reason) each time this request stalled on a worker: ("decode", "no_token"),
        silent past its limit after the first token (``attempt.stall_limit_s``; also a
        ``decode_resume``), or ("prefill", "no_first_token"), a pushed prompt's first token
        late past its limit (``attempt.prefill_stall_limit_s``; also a
        ``prefill_fallback``)."""

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self.request.prompt_token_ids

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    def replay(self, streamed_token_ids: list[int]) -> StreamChunk:
        """Take ``streamed_token_ids`` as already streamed (by another coordinator, which the
        client reports died) before ``run``: attempts go on after them. The chunk is what
        their replay gives (its text already reached the client); it finishes the request
        when they already end it (a stop string)."""
        if len(streamed_token_ids) >= self.params.max_tokens:
            raise InvalidRequestError(
                f"{len(streamed_token_ids)} tokens to continue after, max_tokens is "
                f"{self.params.max_tokens}: nothing left to generate",
                "continue_after",
            )
        self.recoveries.append("coordinator_continuation")
        update = RequestUpdate(
            self.request_id,
            tuple(streamed_token_ids),
            None,
            len(self.prompt_token_ids),
            0,
            len(streamed_token_ids),
        )
        return self.tracker.process(update)

    def abort(self) -> None:
        """End the request as aborted: its stream gets a final ABORT chunk, workers free it."""
        self._aborted = True
        if self._attempt is not None:
            self._attempt.abort()

    @property
    def num_completion_tokens(self) -> int:
        return len(self.tracker.token_ids)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from a prefix cache, as the workers reported them so far."""
        running = self._attempt.num_cached_tokens if self._attempt is not None else 0
        return max(self._num_cached_tokens, running)

    async def run(self, inline: InlineSink | None = None) -> AsyncIterator[StreamChunk]:
        """The request's chunks across its attempts; with ``inline``, the chunks an attempt
        takes inline go there instead (``attempt.py``), in the stream's order."""
        if self.tracker.finished:  # replayed tokens already ended it
            self.state = FlowState.FINISHED
            return
        excluded: list[str] = []
        local_prefill_only = False
        for _ in range(self._config.max_attempts):
            if self._aborted:
                yield self.tracker.abort()
                return
            attempt = self._next_attempt(excluded, local_prefill_only)
            if attempt is None and excluded:  # every worker failed it: a partition may heal
                attempt = await self._worker_back(local_prefill_only)
                excluded.clear()
            if attempt is None:
                break
            self.state = FlowState.RUNNING
            try:
                async with contextlib.aclosing(attempt.run(inline)) as chunks:
                    async for chunk in chunks:
                        yield chunk
                self.state = FlowState.FINISHED
                return
            except PrefillLost as lost:
                local_prefill_only = True
                self.recoveries.append("prefill_fallback")
                if isinstance(lost, PrefillStalled):
                    self.stalls.append(("prefill", "no_first_token"))
            except DecodeLost as lost:
                self.recoveries.append("decode_resume")
                if isinstance(lost, DecodeStalled):
                    self.stalls.append(("decode", "no_token"))
                excluded.append(attempt.route.decode.worker_id)
                self._router.report_failure(attempt.route.decode)
            finally:
                self._num_cached_tokens = self.num_cached_tokens
                self._attempt = None
                if self.placement is None and attempt.route.placement is not None:
                    self.placement = PlacementOutcome(
                        attempt.route.placement, attempt.first_token_s
                    )
                self.stage_seconds.extend(attempt.stage_seconds)
            self.state = FlowState.RESUMING
        self.state = FlowState.FAILED
        raise WorkerUnavailableError(
            f"request {self.request_id}: no worker could serve it "
            f"({self.num_completion_tokens} tokens were streamed)"
        )

    async def _worker_back(self, local_prefill_only: bool) -> Attempt | None:
        """The next attempt once a decode worker takes the request again (the router routes
        to it: registered, healthy, circuit closed), within ``worker_return_wait_s``; None
        after, or once the request is aborted."""
        deadline = time.monotonic() + self._config.worker_return_wait_s
        while time.monotonic() < deadline and not self._aborted:
            await asyncio.sleep(WORKER_RETURN_POLL_S)
            attempt = self._next_attempt([], local_prefill_only)
            if attempt is not None:
                return attempt
        return None

    def _next_attempt(self, excluded: list[str], local_prefill_only: bool) -> Attempt | None:
        """The next attempt, from prompt + tokens streamed so far; None when no decode worker
        can take the request."""
        streamed = list(self.tracker.token_ids)
        with_prefill = not (local_prefill_only or streamed)
        route = self._router.route(self.request, streamed, excluded, with_prefill)
        if route is None:
            return None
        self._attempt = Attempt(
            self.request,
            self.tracker,
            route,
            self._router,
            self._channels,
            self._config.timeouts,
            prior_output_token_ids=streamed,
        )
        return self._attempt
