"""A decode step launched on the device whose tokens the host has not read yet.

``ModelRunner.launch_decode`` replays a decode step whose every token the sampler chooses on
the device alone (``decided_on_device``) and queues, behind it on the same stream: each row's
choice (``Sampler.choose``; ``token_ids``, on the device, where the next step launched ahead
reads its inputs) and their copy to host memory, then an event. ``wait`` blocks on that event
only, not on the stream, so a step launched after this one keeps the device busy while the host
reads these tokens and plans the next step (``EngineCore.step``). Off CUDA everything ran
before ``launch_decode`` returned and ``wait`` returns at once.

Invariant: rows are the step's chunks in order, one token each; ``row_of`` maps each chunk's
request to its row, for the step launched ahead, whose rows are a subsequence of these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.scheduler import ScheduledChunk


@dataclass(frozen=True)
class LaunchedDecode:
    """One launched decode step (module docstring)."""

    serial: int
    """Launches of the runner so far, this one included (``Scheduler.launched``/``settle``)."""
    chunks: tuple[ScheduledChunk, ...]
    token_ids: torch.Tensor  # [rows] int64 on the device: each row's chosen token
    host_token_ids: torch.Tensor  # [rows] int64 on the host: valid once ``ready`` passed
    ready: torch.cuda.Event | None
    """Recorded after the copy to the host; None off CUDA (nothing to wait for)."""

    @property
    def row_of(self) -> dict[str, int]:
        return {chunk.request_id: row for row, chunk in enumerate(self.chunks)}

    def wait(self) -> list[int]:
        """The step's tokens, one per row, once the device has made them."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host_token_ids.tolist()
