"""Runs an ``EngineCore`` on its own thread and streams its outputs to asyncio callers.

The model never runs on the event loop: one engine thread owns the core and loops
schedule -> execute -> update while work exists, and sleeps otherwise. Callers on the loop
submit and abort through a command queue that the engine thread drains between steps; outputs
come back through one ``loop.call_soon_threadsafe`` per loop and step into one
``asyncio.Queue`` per request; a caller that fell behind reads what queued up as one output
(``RequestStream``: the callers' side lives in ``request_stream.py``).

Besides plain requests (``generate`` / ``submit``), a decode worker reserves blocks for KV
computed elsewhere (``submit(..., reserve_remote_prefill=True)``) and later calls
``complete_remote_prefill``; ``call`` runs a function on the engine thread between steps;
the optional layer hook is passed to every step (a prefill worker pushes KV from it).

The face: this class, and what it hands out, is all that code outside ``engine/`` sees of an
engine; the ``EngineCore``, its scheduler and its block pool stay on the engine thread
(``tests/test_engine_face.py``). It hands out ``facts`` (``EngineFacts``: model facts, any
thread), ``paged_kv`` (``PagedKv``: the KV cache, with its threading contract) and
``latest_report`` (``EngineReport``: load figures, scheduler counters, the phase times of the
requests that ended since the previous report). After every step, command batch and serving
of the reservation queue, the engine thread publishes a new report (swapping the reference:
readers on any thread see a whole report), calls the report listeners with it, and only then
posts that round's outputs and command results to the callers' event loops: whoever saw an
output, or awaited a command, finds its effect in ``latest_report``.

Contract: ``generate`` raises the engine's ``InvalidRequestError`` for a request it refuses
(nothing is queued); cancelling the consuming task (also while the request is being accepted),
or leaving ``generate``'s iterator early, aborts the request and frees its blocks. ``abort`` and
``finish`` from elsewhere end the request's stream with a final output whose finish reason is
ABORT / STOP. If a step fails, every running request receives the exception and the engine keeps
serving new ones; a failing command or a caller whose event loop is gone never stops the engine
thread. After ``shutdown`` every open stream receives ``EngineStoppedError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TypeVar

from splitserve.common.adapter_id import AdapterId
from splitserve.common.blocks import BlockHash, prefix_root, prompt_block_hashes
from splitserve.common.errors import EngineStoppedError
from splitserve.common.kv_events import KvEventLog
from splitserve.common.load import EngineLoad
from splitserve.common.logprobs import TokenLogprob
from splitserve.common.request_update import FinishReason, RequestUpdate, StepOutput
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.engine_face import (
    EngineFacts,
    LayerHook,
    PagedKv,
    PulledKv,
    ReservedBlocks,
)
from splitserve.engine.engine_report import EngineReport, RequestPhases, StepTiming
from splitserve.engine.lora import LoraAdapter
from splitserve.engine.request_stream import (
    OutboxEntry,
    OutputStream,
    RequestStream,
    Submission,
    call_soon,
    put_each,
    settle,
)
from splitserve.engine.reservation_queue import (
    DEFAULT_MAX_WAITING,
    PendingReservation,
    ReservationQueue,
)
from splitserve.engine.step_threads import StepThreads

logger = logging.getLogger(__name__)
T = TypeVar("T")
ReportListener = Callable[[EngineReport], None]
"""Called on the engine thread with each published report, before that round's outputs go
out; must be quick and never block (an exception it raises is logged)."""


STREAM_INTERVAL_ENV = "SPLITSERVE_STREAM_INTERVAL_STREAMS"
STREAMS_PER_INTERVAL_STEP = int(os.environ.get(STREAM_INTERVAL_ENV, "32"))
"""Up to this many open streams (``SPLITSERVE_STREAM_INTERVAL_STREAMS``, 32; 0: never hold),
every step's output goes out with that step; past it, a request's outputs go out every
``ceil(streams / STREAMS_PER_INTERVAL_STEP)`` steps (at most ``MAX_STREAM_INTERVAL``) as one,
its first and its last at once: the relay's cost is per message (a coordinator spent about a
third of its CPU in gRPC's write of each token at 64 streams), and a lone stream is never
delayed (vLLM's ``--stream-interval``, chosen by load)."""
MAX_STREAM_INTERVAL = 4


def stream_interval(open_streams: int) -> int:
    """Steps whose outputs a request's stream gathers into one message (see above)."""
    if STREAMS_PER_INTERVAL_STEP <= 0:
        return 1
    return max(1, min(MAX_STREAM_INTERVAL, math.ceil(open_streams / STREAMS_PER_INTERVAL_STEP)))


class AsyncEngine:
    """Thread-hosted engine with an asyncio front."""

    def __init__(
        self,
        core: EngineCore,
        max_waiting_reservations: int = DEFAULT_MAX_WAITING,
        step_threads: StepThreads | None = None,
    ) -> None:
        """``max_waiting_reservations``: remote-prefill reservations that may wait for blocks
        (``ReservationQueue``); more are refused with ``CapacityError``. A layer hook (a
        prefill domain's KV push) is installed with ``set_layer_hook``. ``step_threads``:
        sizes torch's pool before each step and says when this engine idles (core lending
        between co-located workers); None keeps the pool as it is."""
        self._core = core
        """Engine thread only, once the thread runs (``_loop``)."""
        self.facts: EngineFacts = core.facts
        self.paged_kv: PagedKv = core.paged_kv
        """The KV cache for KV transfer; see its threading contract (``PagedKv``)."""
        self.step_threads = step_threads
        self._between_layers = (
            step_threads.between_layers
            if step_threads is not None and step_threads.borrows is not None
            else None
        )
        """Gives borrowed cores back within a step (a borrowing engine only)."""
        self._layer_hook: LayerHook | None = None
        self._finished: list[RequestPhases] = []
        """Requests that ended since the last report (engine thread only)."""
        core.scheduler.on_request_finished = self._finished.append
        self._report = EngineReport(core.load(), core.stats)
        self._report_listeners: tuple[ReportListener, ...] = ()
        self._cached_hashes: set[BlockHash] = set(core.kv_cache.pool.cached_hashes())
        """The prefix cache's block hashes (written on the engine thread, read anywhere:
        single set operations are atomic)."""
        self._kv_log: KvEventLog | None = None
        core.kv_cache.pool.cache_listener = self._cache_changed
        self._outbox: list[OutboxEntry] = []
        """Outputs for callers, posted once the report that shows them is out (engine
        thread only)."""
        self._delivered: set[str] = set()
        """Requests that produced an output since the outbox last went out."""
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, OutputStream] = {}
        self._wakeup = threading.Event()
        self._stopping = False
        self._reservations = ReservationQueue(core, max_waiting_reservations)
        """Remote-prefill reservations waiting for blocks (engine thread only)."""
        core.defer_layouts = True
        self._relayout = False
        """A thread is laying the adapters out again for the engine (``_relayout_off_thread``)."""
        self._after_refresh: list[Callable[[], None]] = []
        """Results of commands, submits and grants to tell their callers once
        ``latest_report`` shows them (engine thread only): a caller that reads the report
        after its command returned sees its effect (``_tell_after_refresh``)."""
        self._step_started: float | None = None
        """``time.monotonic()`` when the running step began; None between steps."""
        self._thread = threading.Thread(target=self._loop, name="splitserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    async def start(
        cls,
        config: EngineConfig,
        max_waiting_reservations: int = DEFAULT_MAX_WAITING,
        step_threads: StepThreads | None = None,
    ) -> AsyncEngine:
        """Load an engine for ``config`` off the event loop (seconds: the weights) and start
        its thread; the arguments after ``config`` are the constructor's."""
        core = await asyncio.to_thread(EngineCore, config)
        return cls(core, max_waiting_reservations, step_threads)

    @property
    def latest_report(self) -> EngineReport:
        """The report as of the last step, command batch or serving of the reservation
        queue; any thread (never waits, never sees a half-built report)."""
        return self._report

    @property
    def latest_load(self) -> EngineLoad:
        """``latest_report.load``: load figures as of the last step or command batch."""
        return self._report.load

    def add_report_listener(self, listener: ReportListener) -> None:
        """Call ``listener`` with every report published from now on (``ReportListener``:
        on the engine thread, before that round's outputs go out). Any thread."""
        self._report_listeners = (*self._report_listeners, listener)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        pulled_kv: PulledKv | None = None,
    ) -> AsyncIterator[StepOutput]:
        """Submit a request and yield its step outputs until it finishes (``pulled_kv``: see
        ``submit``)."""
        stream = await self.submit(request_id, prompt_token_ids, params, pulled_kv=pulled_kv)
        async for output in stream:
            yield output

    async def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        reserve_remote_prefill: bool = False,
        prior_output_token_ids: Sequence[int] = (),
        pulled_kv: PulledKv | None = None,
    ) -> RequestStream:
        """Queue a request and return its stream of outputs; raises what the core raises on
        refusal.

        With ``reserve_remote_prefill``, blocks are reserved for KV computed elsewhere (when
        the pool is short, this waits in arrival order until they free up:
        ``ReservationQueue``; ``CapacityError`` when too many already wait; an ``abort``
        meanwhile cancels the wait) and the stream's ``block_table`` comes with a *hold*: one
        extra reference on each of its blocks, taken in the same engine command as the
        reservation and owned by the caller. Whatever ends the request (abort, a failed
        step), the blocks stay out of the pool until the caller gives the hold back with
        ``release_blocks``: once nothing can write into them any more.
        ``prior_output_token_ids``: see ``EngineCore.add_request``. ``pulled_kv``: KV of
        the prompt's leading blocks another worker sent, entered into the prefix cache in the
        same command as the request (``EngineCore.adopt_pulled_kv``; where it cannot be, the
        request computes those tokens).
        """
        if params.grammar is not None:  # compiled here, on a thread: not in an engine step
            await asyncio.to_thread(self._core.prepare_grammar, params.grammar)
        loop = asyncio.get_running_loop()
        entry = Submission(request_id, OutputStream(loop, asyncio.Queue()), loop.create_future())

        def add() -> None:
            if reserve_remote_prefill:
                self._reserve(entry, prompt_token_ids, params)
            else:
                self._add(entry, prompt_token_ids, params, prior_output_token_ids, pulled_kv)

        self._submit(add)
        try:
            reserved = await entry.accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # commands run in order: this lands after the add
            self.release_blocks(entry.held)  # the caller never saw the table: nothing writes there
            raise
        return RequestStream(self, request_id, entry.stream, reserved)

    def release_blocks(self, block_ids: Sequence[int]) -> None:
        """Give back a hold ``submit`` took on reserved blocks (queued; blocks with no other
        reference return to the pool). ``block_ids`` is read when the command runs."""
        self._post_command(lambda: self._core.release_blocks(block_ids))

    async def record_kv_events(self, log: KvEventLog) -> None:
        """From now on every change of the prefix cache goes into ``log`` (on the engine
        thread, as it happens), which first gets what the cache holds now."""

        def attach() -> None:
            for block_hash in self._core.kv_cache.pool.cached_hashes():
                log.record(block_hash, True)
            self._kv_log = log

        await self.call(attach)

    def _cache_changed(self, block_hash: BlockHash, stored: bool) -> None:
        """The block pool's listener (engine thread): the mirror ``cached_prefix_blocks``
        reads, and the KV event log when one is attached."""
        if stored:
            self._cached_hashes.add(block_hash)
        else:
            self._cached_hashes.discard(block_hash)
        if self._kv_log is not None:
            self._kv_log.record(block_hash, stored)

    def cached_prefix_blocks(self, token_ids: Sequence[int], root: BlockHash | None = None) -> int:
        """Any thread: how many leading full blocks of the prompt ``token_ids`` (its hashes
        chained from ``root``, ``prefix_root`` of its salt and adapter) the prefix cache
        holds, never its last token's (as of the latest change; a step may evict or add
        some before a request submitted now is scheduled)."""
        block_size = self.paged_kv.block_size
        usable = token_ids[: len(token_ids) - 1]
        held = 0
        for block_hash in prompt_block_hashes(usable, block_size, root):
            if block_hash not in self._cached_hashes:
                break
            held += 1
        return held

    @property
    def served_adapters(self) -> tuple[AdapterId, ...]:
        """The LoRA adapters served now (``EngineCore.adapters``); any thread."""
        return tuple(self._core.adapters.values())

    def adapter_digest(self, name: str) -> str:
        """The digest of the adapter served as ``name`` now ("" for ""; ``ModelNotFoundError``
        where none is: ``EngineCore.adapter_digest``); any thread."""
        return self._core.adapter_digest(name)

    async def load_adapter(
        self, name: str, folder: Path, *, replace: bool = False
    ) -> tuple[AdapterId, bool]:
        """Read the LoRA adapter in ``folder`` (``read_adapter``), then serve it as ``name``
        (``serve_adapter``). Returns its id and whether it is newly served (False: ``name``
        served these very files already)."""
        adapter = await self.read_adapter(name, folder)
        return AdapterId(name, adapter.digest), await self.serve_adapter(
            name, adapter, replace=replace
        )

    async def read_adapter(self, name: str, folder: Path) -> LoraAdapter | AdapterId:
        """The adapter in ``folder`` read for this engine (``EngineCore.read_adapter``), on a
        thread of its own: the engine steps on meanwhile."""
        return await asyncio.to_thread(self._core.read_adapter, name, folder)

    async def serve_adapter(
        self,
        name: str,
        adapter: LoraAdapter | AdapterId,
        *,
        replace: bool = False,
        check_only: bool = False,
    ) -> bool:
        """Serve ``adapter`` as ``name`` between two steps, or with ``check_only`` only say
        whether it would be (``EngineCore.serve_adapter``: its answer and refusals). The
        layout with it is built first on a thread of its own (``EngineCore.prepare_layout``),
        so the engine thread only swaps it in."""
        prepared = None
        if not check_only:
            prepared = await asyncio.to_thread(self._core.prepare_layout, adapter)
        return await self.call(
            lambda: self._core.serve_adapter(
                name, adapter, replace=replace, check_only=check_only, prepared=prepared
            )
        )

    async def unload_adapter(self, name: str) -> None:
        """Stop serving the adapter ``name`` (``EngineCore.unserve_adapter``: requests of it
        already running finish with it)."""
        await self.call(lambda: self._core.unserve_adapter(name))

    async def call(self, function: Callable[[], T]) -> T:
        """Run ``function()`` on the engine thread between steps, in order with the other
        commands; returns its result once ``latest_report`` shows every command before it."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result = function()
            except BaseException as error:
                self._tell_after_refresh(loop, done, error, None)
            else:
                self._tell_after_refresh(loop, done, None, result)

        self._submit(run)
        return await done

    async def complete_remote_prefill(
        self,
        request_id: str,
        first_token_id: int,
        first_logprob: TokenLogprob | None = None,
        num_cached_tokens: int = 0,
        prompt_logprobs: Sequence[TokenLogprob] = (),
    ) -> None:
        """The reserved request's KV landed; it joins the batch and its stream gets the token
        (with its logprobs, sampled by the prefill worker, and the prompt's logprobs, when
        given)."""

        def complete() -> None:
            output = self._core.complete_remote_prefill(
                request_id, first_token_id, first_logprob, num_cached_tokens, prompt_logprobs
            )
            self._deliver(output)

        await self.call(complete)

    async def has_request(self, request_id: str) -> bool:
        """Whether the engine knows the request (waiting, running or reserved), as of the
        commands queued before this one."""
        return await self.call(lambda: self._core.has_request(request_id))

    def _post_command(self, function: Callable[[], None]) -> None:
        """Queue ``function()`` to run on the engine thread between steps, in order with the
        other commands (``submit``, ``call``, ``abort``, ``finish``); nothing is returned and
        an error it raises is logged."""

        def run() -> None:
            try:
                function()
            except Exception:
                logger.exception("an engine command failed")

        self._submit(run)

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent; unknown ids are ignored); its stream ends with ABORT."""
        self._submit(lambda: self._end(request_id, FinishReason.ABORT))

    def finish(self, request_id: str) -> None:
        """End a request as stopped (a stop string matched downstream); its stream ends."""
        self._submit(lambda: self._end(request_id, FinishReason.STOP))

    def set_layer_hook(self, hook: LayerHook) -> None:
        """Install the per-layer hook (a prefill domain's KV push) before the first request;
        an engine has at most one. Raises ``ValueError`` when one is installed already."""
        if self._layer_hook is not None:
            raise ValueError("the engine already has a layer hook")
        self._layer_hook = hook

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; open streams receive ``EngineStoppedError``."""
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout)
        stopped = EngineStoppedError("the engine was shut down")
        self._reservations.drop_all(stopped)
        self._fail_all(stopped)
        self._send_outbox()  # the engine thread has ended: nothing publishes any more

    # ---- engine thread ---------------------------------------------------------------------

    def _submit(self, command: Callable[[], None]) -> None:
        if self._stopping:
            raise EngineStoppedError("the engine was shut down")
        self._commands.put(command)
        self._wakeup.set()

    def _add(
        self,
        entry: Submission,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        prior_output_token_ids: Sequence[int],
        pulled_kv: PulledKv | None,
    ) -> None:
        """Engine thread: add a plain request (its ``pulled_kv`` entered first) and open its
        stream, accepted once the report shows it; a refusal goes to the submitter and the
        engine goes on."""
        try:
            if pulled_kv is not None:
                root = prefix_root(params.cache_salt, self._core.adapter_digest(params.adapter))
                self._core.adopt_pulled_kv(prompt_token_ids, pulled_kv, root)
            self._core.add_request(
                entry.request_id, prompt_token_ids, params, prior_output_token_ids
            )
        except BaseException as error:  # reported to the caller, engine goes on
            entry.refuse(error)
            return
        self._streams[entry.request_id] = entry.stream
        self._tell_after_refresh(entry.stream.loop, entry.accepted, None, None)

    def _reserve(
        self, entry: Submission, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        """Engine thread: offer a remote-prefill reservation to the queue (granted at once
        or when blocks free up: ``_grant``; dropped: ``Submission.dropped``); a refusal goes
        to the submitter and the engine goes on."""
        try:
            request = self._core.remote_prefill_request(entry.request_id, prompt_token_ids, params)
            grant = functools.partial(self._grant, entry)
            self._reservations.offer(PendingReservation(request, grant, entry.dropped))
        except BaseException as error:  # reported to the caller, engine goes on
            entry.refuse(error)

    def _grant(self, entry: Submission, reserved: ReservedBlocks) -> None:
        """Engine thread: the reservation got its blocks; the caller's hold is taken on them
        and its stream opens, accepted once the report shows it."""
        self._core.hold_blocks(reserved.block_ids)
        entry.held.extend(reserved.block_ids)
        self._streams[entry.request_id] = entry.stream
        # every grant (in a command or in serving the queue) is followed by a refresh
        self._tell_after_refresh(entry.stream.loop, entry.accepted, None, reserved)

    def _end(self, request_id: str, reason: FinishReason) -> None:
        """Engine thread: finish a request in the core and close its stream."""
        if self._reservations.drop(request_id):
            return  # it was still waiting for blocks: no stream, nothing held
        request = self._core.scheduler.requests.get(request_id)
        if reason is FinishReason.ABORT:
            self._core.abort_request(request_id)
        else:
            self._core.finish_request(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        final = RequestUpdate(
            request_id=request_id,
            new_token_ids=(),
            finish_reason=reason,
            num_prompt_tokens=request.num_prompt_tokens if request else 0,
            num_cached_tokens=request.num_cached_tokens if request else 0,
            num_output_tokens=request.num_output_tokens if request else 0,
        )
        if stream.held is not None:  # its held tokens go first
            self._post(request_id, stream, stream.held)
        self._post(request_id, stream, StepOutput(final))

    def _loop(self) -> None:
        if self.step_threads is not None:
            self.step_threads.start()
        while not self._stopping:
            self._drain_commands()
            if self._core.layout_stale and not self._relayout:
                self._relayout_off_thread()
            if self._serve_reservations():
                self._publish()
            if not self._core.has_unfinished:
                if self.step_threads is not None:
                    self.step_threads.idle()
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            if self.step_threads is not None:
                self.step_threads.before_step()
            self._step_started = time.monotonic()
            try:
                outputs = self._core.step(self._layer_hook, self._between_layers)
            except Exception as error:  # a bug or OOM in a step must not kill the server
                logger.exception("engine step failed; failing its running requests")
                self._fail_all(error)
                self._publish()
                continue
            finally:
                self._step_started = None
            timing = self._core.last_step
            if self.step_threads is not None:
                self.step_threads.after_step(timing.seconds, timing.predicted_s)
            for output in outputs:
                self._deliver(output)
            self._serve_reservations()
            self._publish(timing)

    def _relayout_off_thread(self) -> None:
        """Engine thread: lay the banked adapters out again on a thread of its own (an
        adapter retired: ``EngineCore.layout_stale``), then take the layout between two
        steps where the adapters banked are still the same (else the next loop tries
        again). Steps meanwhile keep the old layout, the retired adapter in it unused."""
        self._relayout = True

        def build() -> None:
            try:
                prepared = self._core.prepare_layout()
            except Exception:  # the old layout keeps serving; a later change tries again
                logger.exception("laying the LoRA adapters out again failed")
                prepared = None

            def install() -> None:
                self._relayout = False
                if prepared is not None:
                    self._core.install_layout(prepared)

            with contextlib.suppress(EngineStoppedError):  # shut down meanwhile
                self._submit(install)

        threading.Thread(target=build, name="lora-layout", daemon=True).start()

    def _serve_reservations(self) -> bool:
        """Grant waiting reservations the pool can take now (blocks come back only in
        commands and steps, after which this runs); whether any left the queue (the load
        figures are then stale)."""
        return bool(self._reservations) and self._reservations.serve() > 0

    def _tell_after_refresh(
        self,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[T],
        error: BaseException | None,
        result: T,
    ) -> None:
        """Settle ``future`` on ``loop`` once ``latest_report`` includes what the engine
        thread just did (engine thread only; a report follows every command batch and every
        serving of the reservation queue): whoever awaited a command, a submit or a grant and
        then reads the report sees its effect."""
        self._after_refresh.append(lambda: call_soon(loop, settle, future, error, result))

    def _publish(self, step: StepTiming | None = None) -> None:
        """Engine thread: a new ``latest_report`` (reservations waiting for blocks count as
        waiting requests; ``step``: the step just taken, if one was), handed to the
        listeners; then this round's outputs and command results go out to their callers."""
        load = self._core.load()
        if len(self._reservations):
            waiting = load.num_waiting_requests + len(self._reservations)
            load = dataclasses.replace(load, num_waiting_requests=waiting)
        finished = tuple(self._finished)
        self._finished.clear()
        report = self._report = EngineReport(
            load, self._core.stats, finished, step, self._core.lora_requests()
        )
        for listener in self._report_listeners:
            try:
                listener(report)
            except Exception:  # metrics must not stop the engine thread
                logger.exception("an engine report listener failed")
        self._send_outbox()
        notices, self._after_refresh = self._after_refresh, []
        for notice in notices:
            notice()

    def step_running_s(self) -> float:
        """Seconds the step now running has taken; 0 between steps. Any thread: a stuck
        step (a hung hook, a deadlock) shows as a number that keeps growing."""
        started = self._step_started
        return 0.0 if started is None else max(0.0, time.monotonic() - started)

    def _drain_commands(self) -> None:
        ran_any = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                if ran_any:  # commands add, reserve and end requests
                    self._publish()
                return
            ran_any = True
            try:
                command()
            except Exception:  # one bad command must not stop the engine thread
                logger.exception("engine command failed")

    def _deliver(self, output: StepOutput) -> None:
        """Send ``output`` with this round, or hold it to go out with the request's next
        steps' (``stream_interval``); a request's first and last outputs always go."""
        request_id = output.update.request_id
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if stream.held is not None:
            output = stream.held.followed_by(output)
        self._delivered.add(request_id)
        if output.update.finish_reason is not None:
            del self._streams[request_id]
        elif stream.sent_any and stream.held_steps + 1 < stream_interval(len(self._streams)):
            stream.held, stream.held_steps = output, stream.held_steps + 1
            return
        stream.held, stream.held_steps, stream.sent_any = None, 0, True
        self._post(request_id, stream, output)

    def _flush_idle_holds(self) -> None:
        """A held output whose request produced nothing this round goes out now (it was
        preempted, or a command round came between steps): nothing waits for a step that
        may not come."""
        for request_id, stream in self._streams.items():
            if stream.held is not None and request_id not in self._delivered:
                self._post(request_id, stream, stream.held)
                stream.held, stream.held_steps = None, 0
        self._delivered.clear()

    def _post(
        self, request_id: str, stream: OutputStream, item: StepOutput | BaseException
    ) -> None:
        """Queue an item for the caller's loop; it goes out with the next report."""
        self._outbox.append((request_id, stream, item))

    def _send_outbox(self) -> None:
        """Hand the queued items to their callers' loops, one wake-up per loop (not one per
        request: a step of N requests woke the worker's loop N times); a caller whose loop
        is gone loses its request."""
        self._flush_idle_holds()
        outbox, self._outbox = self._outbox, []
        by_loop: dict[asyncio.AbstractEventLoop, list[OutboxEntry]] = {}
        for entry in outbox:
            by_loop.setdefault(entry[1].loop, []).append(entry)
        for loop, entries in by_loop.items():
            try:
                loop.call_soon_threadsafe(put_each, entries)
            except RuntimeError:  # the event loop was closed
                for request_id, _, _ in entries:
                    self._streams.pop(request_id, None)
                    self._core.abort_request(request_id)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            self._core.abort_request(request_id)
            if stream.held is not None:  # the tokens it made reach the caller before the error
                self._post(request_id, stream, stream.held)
            self._post(request_id, stream, error)
        self._streams.clear()
