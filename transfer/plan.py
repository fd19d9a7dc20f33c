"""Which bytes of one request's KV travel in which tagged message (torch-free).

The decode worker receives straight into the blocks it reserved, so a message must cover a
region that is contiguous in its KV cache ``[layers, 2, blocks, block_size, kv_heads,
head_dim]``: the K (or V) of a *run* of consecutive block ids of one layer. The decode worker
makes the plan from its reserved block ids and sends it in the reservation; the prefill worker
gathers the prompt's blocks in the plan's ``block_order`` and cuts each layer into the same
messages.

Messages of one layer, in order: K of run 0, K of run 1, ..., V of run 0, V of run 1, ...; the
message of ``(layer, kv, run)`` has index ``layer * messages_per_layer + kv * num_runs + run``
and tag ``message_tag(transfer_id, index)``.

Invariants of a ``TransferPlan``: ``block_order`` is a permutation of ``range(num_blocks)``;
``run_lengths`` are positive and sum to ``num_blocks``; every message index fits in
``MESSAGE_BITS``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MESSAGE_BITS = 20
"""Message index bits of a tag; the transfer id takes the upper 44."""
MAX_TRANSFER_ID = (1 << (64 - MESSAGE_BITS)) - 1
MAX_MESSAGES = 1 << MESSAGE_BITS


def message_tag(transfer_id: int, index: int) -> int:
    """The 64-bit tag of message ``index`` of one transfer (tags are never reused)."""
    if not 0 <= transfer_id <= MAX_TRANSFER_ID or not 0 <= index < MAX_MESSAGES:
        raise ValueError(f"tag out of range: transfer {transfer_id}, message {index}")
    return (transfer_id << MESSAGE_BITS) | index


class InvalidTransferPlanError(ValueError):
    """A plan that does not describe a permutation of the request's blocks into runs."""


@dataclass(frozen=True)
class TransferPlan:
    """How one request's blocks are cut into messages (see the module docstring)."""

    block_order: tuple[int, ...]
    """Positions of the prompt's blocks (0 = its first block) in the order messages carry
    them: ascending destination block id."""
    run_lengths: tuple[int, ...]
    """Blocks per run; a run is a stretch of consecutive destination block ids."""

    def __post_init__(self) -> None:
        if sorted(self.block_order) != list(range(len(self.block_order))):
            raise InvalidTransferPlanError("block_order is not a permutation of the blocks")
        if any(length <= 0 for length in self.run_lengths):
            raise InvalidTransferPlanError("run lengths must be positive")
        if sum(self.run_lengths) != len(self.block_order):
            raise InvalidTransferPlanError(
                f"runs cover {sum(self.run_lengths)} blocks, the order {len(self.block_order)}"
            )

    @classmethod
    def for_destination(cls, block_ids: Sequence[int]) -> TransferPlan:
        """The plan for receiving into ``block_ids`` (the reserved blocks, in the order of the
        request's block table; distinct)."""
        if len(set(block_ids)) != len(block_ids):
            raise InvalidTransferPlanError("destination block ids repeat")
        order = sorted(range(len(block_ids)), key=lambda position: block_ids[position])
        runs: list[int] = []
        previous: int | None = None
        for position in order:
            block = block_ids[position]
            if previous is not None and block == previous + 1:
                runs[-1] += 1
            else:
                runs.append(1)
            previous = block
        return cls(tuple(order), tuple(runs))

    @property
    def num_blocks(self) -> int:
        return len(self.block_order)

    @property
    def num_runs(self) -> int:
        return len(self.run_lengths)

    @property
    def messages_per_layer(self) -> int:
        """K and V of every run."""
        return 2 * len(self.run_lengths)

    def run_offsets(self) -> list[int]:
        """Index (in ``block_order``) of each run's first block."""
        offsets, offset = [], 0
        for length in self.run_lengths:
            offsets.append(offset)
            offset += length
        return offsets

    def message_index(self, layer: int, kv: int, run: int) -> int:
        return layer * self.messages_per_layer + kv * self.num_runs + run

    def check_fits(self, num_layers: int) -> None:
        """Raise ``InvalidTransferPlanError`` when ``num_layers`` layers need more message
        indices than a tag holds (a pathologically fragmented reservation)."""
        if num_layers * self.messages_per_layer > MAX_MESSAGES:
            raise InvalidTransferPlanError(
                f"{num_layers} layers x {self.messages_per_layer} messages exceed the "
                f"{MAX_MESSAGES} messages a transfer may have"
            )
