"""How a worker moves KV: the operator's settings its domain objects share (``--transfer-timeout``,
``--pull-cached-kv-min-blocks``, ``--kv-message-bytes``)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PULL_MIN_BLOCKS = 1
"""By default a prefill worker pulls a decode worker's cached prefix of a prompt whenever that
worker holds at least one more of its leading blocks than it does. A pull waits for neither
engine's step (the decode worker reads held blocks off its engine thread on a host cache; the
prefill engine takes the KV in with the request's own command), so it costs a gRPC round trip
and two copies, against about 40 ms of float32 compute per 16-token block on one core of
the Cascade Lake Xeon it was measured on (bench/log/2026-11.md, 2026-11-27: from one block on, turns
2-4 computed 76-81 tokens where from two they computed 83-88, at the same TTFT)."""


@dataclass(frozen=True)
class TransferSettings:
    timeout_s: float
    """How long one KV transfer (either way) may take before it fails."""
    pull_min_blocks: int = DEFAULT_PULL_MIN_BLOCKS
    """A prefill worker pulls a decode worker's cached prefix of a prompt (the reverse
    transfer, ``prefill/worker.py``) when it would receive at least this many blocks; 0:
    never (it computes whatever its own prefix cache lacks)."""
    min_message_bytes: int | None = None
    """The smallest message this worker's receivers ask for (``transfer/plan.py``: Groups;
    0: one layer a message); None: ``transfer/destination.py:MIN_MESSAGE_BYTES`` of the
    cache's device."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"--transfer-timeout must be positive, not {self.timeout_s}")
        if self.pull_min_blocks < 0:
            raise ValueError(
                f"--pull-cached-kv-min-blocks must be >= 0, not {self.pull_min_blocks}"
            )
        if self.min_message_bytes is not None and self.min_message_bytes < 0:
            raise ValueError(f"--kv-message-bytes must be >= 0, not {self.min_message_bytes}")
