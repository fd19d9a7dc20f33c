"""How a worker moves KV: the operator's settings its domain objects share (``--transfer-timeout``,
``--pull-cached-kv-min-blocks``)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PULL_MIN_BLOCKS = 2
"""By default a prefill worker pulls a decode worker's cached prefix of a prompt when that
worker holds at least two more of its leading blocks (32 tokens at the default block size)
than it does: below that, computing them costs about what the pull's extra round trips do."""


@dataclass(frozen=True)
class TransferSettings:
    timeout_s: float = 30.0
    """How long one KV transfer (either way) may take before it fails."""
    pull_min_blocks: int = DEFAULT_PULL_MIN_BLOCKS
    """A prefill worker pulls a decode worker's cached prefix of a prompt (the reverse
    transfer, ``prefill/worker.py``) when it would receive at least this many blocks; 0:
    never (it computes whatever its own prefix cache lacks)."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"a transfer timeout must be positive, not {self.timeout_s}")
        if self.pull_min_blocks < 0:
            raise ValueError(
                f"--pull-cached-kv-min-blocks must be >= 0, not {self.pull_min_blocks}"
            )
