"""The KV handoff's typed messages: the reservation (transfer descriptor) both sides share,
the handshake, the first token and the prefill's answer.

The decode worker makes a ``KvReservation`` when it reserves blocks for a prompt computed
elsewhere; the coordinator carries it from the decode stream to the prefill worker's
``Prefill`` call; the prefill worker pushes the prompt's KV as it says. ``proto/convert.py``
holds the one converter pair of each type (e.g. ``reservation_to_proto`` /
``reservation_from_proto``).

Invariant: the reserved blocks hold ``num_tokens`` prompt tokens, so
``plan.num_blocks == ceil(num_tokens / block_size)`` of the decode worker's layout; the
prefill worker checks that against its own prompt and layout before sending anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.common.logprobs import TokenLogprob
from splitserve.transfer.layout import KvLayout
from splitserve.transfer.plan import TransferPlan


@dataclass(frozen=True)
class KvReservation:
    """Where a prefill worker must push one request's KV."""

    transfer_id: int
    """Unique on the decode worker; the UCX tags of the transfer's messages derive from it."""
    decode_address: str
    """The decode worker's gRPC address (handshake, ``CompleteKv``)."""
    num_tokens: int
    """Prompt tokens the reserved blocks hold."""
    compat_hash: str
    """The decode worker's KV layout hash; the prefill worker's must be equal."""
    plan: TransferPlan
    """How the KV is cut into messages: block order and runs of consecutive blocks."""

    @property
    def num_blocks(self) -> int:
        return self.plan.num_blocks


@dataclass(frozen=True)
class PrefillDone:
    """The prefill worker's answer to ``Prefill``: the prompt was computed, its KV landed in
    the reservation and the first token went to the decode worker (which streams it)."""

    num_cached_tokens: int
    """Prompt tokens the prefill worker served from its prefix cache."""


@dataclass(frozen=True)
class KvHandshake:
    """The decode worker's answer to a prefill worker's handshake (once per pair)."""

    layout: KvLayout
    """The decode worker's KV layout (the prefill worker's was found compatible)."""
    transport: str
    """The transport's name (``ucx``, ``inprocess``); both sides must use the same."""
    transport_address: bytes
    """The decode worker's transport address, opaque (a UCX worker address)."""


@dataclass(frozen=True)
class FirstToken:
    """What a prefill worker hands the decode worker with ``CompleteKv``: the token it sampled
    after the prompt, that token's logprobs when the request asked for them, and how much of
    the prompt its prefix cache served (the decode stream reports it in its usage)."""

    token_id: int
    logprob: TokenLogprob | None = None
    num_cached_tokens: int = 0
