"""A worker's KV layout and the compatibility hash checked at the transfer handshake.

Torch-free, in ``common/`` because both the membership records (``membership.WorkerInfo``)
and ``transfer/`` use it. Two workers may exchange KV only when every field of their
``KvLayout`` is equal; ``compat_hash`` is a digest of all fields so that peers can compare one
string, and ``check_compatible`` names each differing field in its error.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

from splitserve.common.errors import IncompatibleKvLayoutError

LAYER_UNIT_LAYOUT = (
    "one message per group of the plan's layers_per_message layers, each K then V; "
    "block=block_size,kv_heads,head_dim"
)
"""What a message holds (``transfer/plan.py``): for each layer of its group, in order, that
layer's K of every block that travels, then its V, blocks in the plan's order. Peers built with
another message format (before it, one message per layer, whatever the plan; before that, one
message per K or V of each run of blocks) are refused at the handshake, naming ``layout``."""


@dataclass(frozen=True)
class KvLayout:
    """Everything that must match for one worker's KV bytes to mean the same to another."""

    model: str
    """Model identity (checkpoint name)."""
    dtype: str
    """KV cache element type, e.g. "bfloat16"."""
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout: str = LAYER_UNIT_LAYOUT

    @property
    def compat_hash(self) -> str:
        fields = "|".join(str(value) for value in dataclasses.astuple(self))
        return hashlib.blake2b(fields.encode(), digest_size=16).hexdigest()

    @property
    def element_size(self) -> int:
        return {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]

    def layer_bytes(self, num_blocks: int) -> int:
        """Bytes of one layer's K and V over ``num_blocks`` blocks (all its messages)."""
        return (
            2 * num_blocks * self.block_size * self.num_kv_heads * self.head_dim
        ) * self.element_size

    def check_compatible(self, peer: KvLayout) -> None:
        """Raise ``IncompatibleKvLayoutError`` naming every field that differs from ``peer``."""
        if peer.compat_hash == self.compat_hash:
            return
        differences = [
            f"{field.name}: local={getattr(self, field.name)!r} peer={getattr(peer, field.name)!r}"
            for field in dataclasses.fields(self)
            if getattr(self, field.name) != getattr(peer, field.name)
        ]
        raise IncompatibleKvLayoutError(
            "KV layouts are incompatible, refusing to pair these workers ("
            + "; ".join(differences)
            + ")"
        )
