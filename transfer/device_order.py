"""Ordering device work against UCX, which reads and writes CUDA memory outside stream order.

UCX moves CUDA memory on streams of its own (or of a peer process) and reports a send complete
once it read the buffer, a receive once the data is in device memory. So, around UCX, work a
stream queued must have *run*, not only be queued: before UCX reads a buffer a kernel writes (a
send of a layer just gathered), before UCX writes a buffer a kernel still reads or writes (a
receive posted into reused staging, or into a buffer just armed with a canary), and before a
receiver calls its transfer done (the scatter of its last layer into the destination).

``Fence`` marks the work queued so far on one stream; ``await fence.wait()`` returns once it
ran, without blocking the event loop: at once when it already ran (a stream or event query), or
after one turn of the loop if it ran by then, else through a blocking CUDA event waited on a
worker thread (the thread sleeps, the loop runs on). On the CPU there is nothing to order (host
work is done when the call doing it returns), and every fence is passed.

``transfer_stream(device)`` is the stream a receiver's own device work (its staging scatters,
its canaries) is queued on: one per CUDA device and process, apart from the current stream
the engine queues its steps on, so that a layer's scatter never waits behind a model step.
None on the CPU. ``on_stream(stream)`` makes it current (nothing on the CPU).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Iterator

import torch


class Fence:
    """The work queued on ``stream`` when this is made (nothing for ``None``, the CPU)."""

    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        self._event: torch.cuda.Event | None = None
        if stream is not None and not stream.query():  # an idle stream needs no event
            self._event = torch.cuda.Event(blocking=True)
            self._event.record(stream)

    def passed(self) -> bool:
        """Whether that work has run."""
        return self._event is None or self._event.query()

    async def wait(self) -> None:
        """Return once that work has run, never blocking the loop: at once if it has, after one
        turn of the loop if it has by then (a layer's copy takes microseconds), else once a
        worker thread saw the event complete."""
        if self.passed():
            return
        await asyncio.sleep(0)
        if not self.passed():
            assert self._event is not None
            await asyncio.to_thread(self._event.synchronize)


@functools.cache
def _stream_of(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def transfer_stream(device: torch.device) -> torch.cuda.Stream | None:
    """This process's stream for transfer work on ``device``; None for host memory."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _stream_of(torch.device("cuda", index))


def follow_current(stream: torch.cuda.Stream | None, device: torch.device) -> None:
    """Queue on ``stream`` a wait for the work queued so far on ``device``'s current stream
    (a buffer the caching allocator handed out may still be in use there); nothing on CPU."""
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(device))


@contextlib.contextmanager
def on_stream(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """``stream`` current within the block (nothing for ``None``)."""
    if stream is None:
        yield
        return
    with torch.cuda.stream(stream):
        yield
