"""Runs an ``EngineCore`` on its own thread and streams its outputs to asyncio callers.

The model never runs on the event loop: one engine thread owns the core and loops
schedule -> execute -> update while work exists, and sleeps otherwise. Callers on the loop
submit and abort through a command queue that the engine thread drains between steps; outputs
come back through ``loop.call_soon_threadsafe`` into one ``asyncio.Queue`` per request.

Contract: ``generate`` raises the engine's ``InvalidRequestError`` for a request it refuses
(nothing is queued); cancelling the consuming task, or leaving ``generate``'s iterator early,
aborts the request and frees its blocks. If a step fails, every running request receives the
exception and the engine keeps serving new ones.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from splitserve.engine.engine_core import EngineCore, StepOutput
from splitserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[StepOutput | BaseException]


class AsyncEngine:
    """Thread-hosted engine with an asyncio front."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wakeup = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="splitserve-engine", daemon=True)
        self._thread.start()

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[StepOutput]:
        """Submit a request and yield its step outputs until it finishes."""
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        accepted: asyncio.Future[None] = loop.create_future()

        def add() -> None:
            try:
                self.core.add_request(request_id, prompt_token_ids, params)
            except BaseException as error:  # reported to the caller, engine goes on
                loop.call_soon_threadsafe(_settle, accepted, error)
                return
            self._streams[request_id] = stream
            loop.call_soon_threadsafe(_settle, accepted, None)

        self._submit(add)
        await accepted
        finished = False
        try:
            while True:
                item = await stream.outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.update.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent; unknown ids are ignored)."""

        def abort() -> None:
            self._streams.pop(request_id, None)
            self.core.abort_request(request_id)

        self._submit(abort)

    def finish(self, request_id: str) -> None:
        """End a request as stopped (a stop string matched downstream)."""

        def finish() -> None:
            self._streams.pop(request_id, None)
            self.core.finish_request(request_id)

        self._submit(finish)

    def run_in_engine_thread(self, function: Callable[[], None]) -> None:
        """Run ``function`` on the engine thread between steps (for state reads/writes)."""
        self._submit(function)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout)

    # ---- engine thread ---------------------------------------------------------------------

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _loop(self) -> None:
        while not self._stopping:
            self._drain_commands()
            if not self.core.has_unfinished:
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                outputs = self.core.step()
            except Exception as error:  # a bug or OOM in a step must not kill the server
                logger.exception("engine step failed; failing its running requests")
                self._fail_all(error)
                continue
            for output in outputs:
                self._deliver(output)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _deliver(self, output: StepOutput) -> None:
        request_id = output.update.request_id
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if output.update.finish_reason is not None:
            del self._streams[request_id]
        stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, output)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            self.core.abort_request(request_id)
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, error)
        self._streams.clear()


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
