"""Which bytes of one request's KV travel in which tagged message (torch-free).

One message per ``layers_per_message`` consecutive layers (a *group*; 1 unless the receiver
asked for more). A layer's part is its K and V of every block that travels, ``[2, num_blocks,
block_size, kv_heads, head_dim]`` with the blocks in the plan's ``block_order`` (ascending
destination block id): the K of every block, then the V of every block, as the prefill
worker's gather of one layer (``kv_io.gather_layer``) lays them out. Message ``m`` is the parts
of layers ``m * g .. m * g + g - 1`` in layer order, ``[g, 2, num_blocks, ...]``: the gathers of
those layers into the sender's staging buffer ``[layers, 2, num_blocks, ...]``, which are
adjacent, so the sender sends them as they lie. Its tag is ``message_tag(secret, m)``. The
receiver makes the plan from its destination's block ids and sends it (the decode worker in the
reservation, a prefill worker pulling cached KV in its ask).

Groups: the cost of a message is mostly fixed (a rendezvous, a completion, a canary check: some
36-56 us each over UCX's cuda_ipc on the H200 of 2026-11-26, where a 4 MiB layer's bytes take 12
us), so a receiver whose layers are small asks for groups of at least ``min_message_bytes``
(``group_layers``): the smallest divisor ``g`` of the layer count whose group reaches it, so
that every message has the same size. The price is granularity: a group leaves the sender when
its last layer was computed, so what a push exposes after the prefill is one group's transfer
instead of one layer's.

Runs: ``run_lengths`` cut the blocks, in ``block_order``, into stretches of consecutive
destination block ids. The K (or V) of a run is contiguous in the receiver's cache ``[layers,
2, blocks, ...]``, so a received layer lands in its blocks with two copies per run, or one
indexed copy (``transfer/destination.py``); a message's size and the runs do not depend on
each other.

Tags are unguessable: ``secret`` is the transfer's 128-bit secret, drawn from a CSPRNG by the
decode worker for each reservation (``new_transfer_secret``) and handed only to the prefill
worker that pushes the KV (in the reservation, over gRPC). A tag is a keyed hash (BLAKE2b, the
secret as key) of the message index, so knowing a transfer's id, other transfers' tags or other
messages' tags of the same transfer tells nothing about a tag to come: whoever can reach a
decode worker's UCX address cannot aim a message at reserved blocks without the secret.

Invariants of a ``TransferPlan``: ``block_order`` is a permutation of ``range(num_blocks)``;
``run_lengths`` are positive and sum to ``num_blocks``; ``layers_per_message`` is positive
(that it divides the layer count is checked where the layer count is known:
``messages_for``).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from splitserve.common.errors import InvalidRequestError

TRANSFER_SECRET_BYTES = 16
"""Bytes of a transfer's secret (128 bits)."""
_TAG_PERSON = b"splitserve-kvtag"
"""BLAKE2b personalization of message tags (domain separation; at most 16 bytes)."""
_INDEX_BYTES = 8


def new_transfer_secret() -> bytes:
    """A fresh transfer secret from the operating system's CSPRNG."""
    return secrets.token_bytes(TRANSFER_SECRET_BYTES)


def message_tag(secret: bytes, index: int) -> int:
    """The 64-bit tag of message ``index`` (the group of layers it carries) of the transfer
    whose secret is ``secret``.

    ``BLAKE2b-64(key=secret, person="splitserve-kvtag", data=index as 8 bytes big-endian)``:
    the same secret and index give the same tag on both sides; without the secret a tag is
    indistinguishable from a uniformly random 64-bit number.
    """
    if len(secret) != TRANSFER_SECRET_BYTES:
        raise ValueError(f"a transfer secret has {TRANSFER_SECRET_BYTES} bytes, not {len(secret)}")
    if not 0 <= index < 1 << (8 * _INDEX_BYTES):
        raise ValueError(f"message index out of range: {index}")
    digest = hashlib.blake2b(
        index.to_bytes(_INDEX_BYTES, "big"), digest_size=8, key=secret, person=_TAG_PERSON
    )
    return int.from_bytes(digest.digest(), "big")


class InvalidTransferPlanError(ValueError):
    """A plan that does not describe a permutation of the request's blocks into runs, or
    groups of layers that do not divide the layers."""


def group_layers(num_layers: int, layer_bytes: int, min_message_bytes: int) -> int:
    """Layers per message for a transfer of ``num_layers`` layers of ``layer_bytes`` each: the
    smallest divisor ``g`` of ``num_layers`` with ``g * layer_bytes >= min_message_bytes``
    (``num_layers`` when none reaches it; 1 for ``min_message_bytes <= layer_bytes``)."""
    for group in range(1, num_layers + 1):
        if num_layers % group == 0 and group * layer_bytes >= min_message_bytes:
            return group
    return max(num_layers, 1)


@dataclass(frozen=True)
class TransferPlan:
    """In which order one request's blocks travel, and their runs (see the module docstring)."""

    block_order: tuple[int, ...]
    """Positions of the prompt's blocks (0 = its first block) in the order a layer's message
    carries them: ascending destination block id."""
    run_lengths: tuple[int, ...]
    """Blocks per run; a run is a stretch of consecutive destination block ids."""
    layers_per_message: int = 1
    """Consecutive layers each message carries (``group_layers``)."""

    def __post_init__(self) -> None:
        if self.layers_per_message < 1:
            raise InvalidTransferPlanError(
                f"layers per message must be positive, not {self.layers_per_message}"
            )
        if sorted(self.block_order) != list(range(len(self.block_order))):
            raise InvalidTransferPlanError("block_order is not a permutation of the blocks")
        if any(length <= 0 for length in self.run_lengths):
            raise InvalidTransferPlanError("run lengths must be positive")
        if sum(self.run_lengths) != len(self.block_order):
            raise InvalidTransferPlanError(
                f"runs cover {sum(self.run_lengths)} blocks, the order {len(self.block_order)}"
            )

    @classmethod
    def for_destination(cls, block_ids: Sequence[int], layers_per_message: int = 1) -> TransferPlan:
        """The plan for receiving into ``block_ids`` (the reserved blocks, in the order of the
        request's block table; distinct), ``layers_per_message`` layers a message."""
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
        return cls(tuple(order), tuple(runs), layers_per_message)

    @property
    def num_blocks(self) -> int:
        return len(self.block_order)

    @property
    def num_runs(self) -> int:
        return len(self.run_lengths)

    def check_groups(self, num_layers: int, param: str) -> None:
        """A peer's plan, for a model of ``num_layers`` layers: ``InvalidRequestError`` naming
        ``param`` when its groups do not divide them."""
        try:
            self.messages_for(num_layers)
        except InvalidTransferPlanError as error:
            raise InvalidRequestError(f"bad transfer plan: {error}", param) from None

    def messages_for(self, num_layers: int) -> int:
        """Messages of a transfer of ``num_layers`` layers; ``InvalidTransferPlanError`` when
        the groups do not divide them."""
        if num_layers % self.layers_per_message:
            raise InvalidTransferPlanError(
                f"{self.layers_per_message} layers a message do not divide {num_layers} layers"
            )
        return num_layers // self.layers_per_message

    def layers_of(self, message: int) -> range:
        """The layers message ``message`` carries, in its order."""
        first = message * self.layers_per_message
        return range(first, first + self.layers_per_message)

    def run_offsets(self) -> list[int]:
        """Index (in ``block_order``) of each run's first block."""
        offsets, offset = [], 0
        for length in self.run_lengths:
            offsets.append(offset)
            offset += length
        return offsets
