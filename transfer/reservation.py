"""The KV handoff's typed messages: the reservation (transfer descriptor) both sides share,
the handshake, the first token and the prefill's answer.

The decode worker makes a ``KvReservation`` when it reserves blocks for a prompt computed
elsewhere; the coordinator carries it, as the wire message and unread, from the decode
stream to the prefill worker's ``Prefill`` call; the prefill worker, the one side that
converts and checks it, pushes the prompt's KV as it says. ``proto/convert.py``
holds the one converter pair of each type (e.g. ``reservation_to_proto`` /
``reservation_from_proto``).

Invariant: the prompt's ``num_tokens`` tokens fill ``ceil(num_tokens / block_size)`` blocks
of the decode worker's layout, of which the first ``num_cached_blocks`` the decode worker
already holds (its prefix cache: a conversation's earlier turns) and ``plan.num_blocks``
receive the rest: ``num_cached_blocks + plan.num_blocks == ceil(num_tokens / block_size)``,
and at least one block travels. The prefill worker checks that against its own prompt and
layout before sending anything, and sends only the blocks after the cached ones.

Secrecy: ``KvReservation.transfer_secret`` is what makes the transfer's UCX tags unguessable
(``plan.message_tag``). It travels only inside gRPC calls (decode stream -> coordinator ->
``Prefill``) and is left out of ``repr``, so logging a reservation never writes it down.

``FirstToken`` comes from the prefill worker, a peer: ``check`` bounds its ids and counts
before the decode worker lets it near its engine.

The reverse transfer: a prefill worker whose prefix cache lacks blocks the decode worker
counted in ``num_cached_blocks`` (a conversation's last reply, decoded there) may post
receives for them and ask for their KV with a ``CachedKvPull``, which names the open
reservation, the blocks, and where they land (its transport address, the ``TransferPlan`` of
its buffer and a secret of its own drawn, so the same tag rules hold in this direction); it
then computes only the tokens after them. The decode worker sends only blocks of that open
reservation's cached prefix, which its hold keeps from being evicted or written meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.common.errors import InvalidRequestError
from splitserve.common.kv_layout import KvLayout
from splitserve.common.logprobs import TokenLogprob
from splitserve.common.sampling_params import MAX_LOGPROBS
from splitserve.transfer.plan import TRANSFER_SECRET_BYTES, TransferPlan


@dataclass(frozen=True)
class KvReservation:
    """Where a prefill worker must push one request's KV."""

    transfer_id: int
    """Random 64-bit id, unique among the decode worker's open transfers: names the transfer
    in ``CompleteKv`` (with the request id) and in logs. Not a secret."""
    decode_address: str
    """The decode worker's gRPC address (handshake, ``CompleteKv``)."""
    num_tokens: int
    """Prompt tokens the reserved blocks hold."""
    compat_hash: str
    """The decode worker's KV layout hash; the prefill worker's must be equal."""
    plan: TransferPlan
    """How the KV of the blocks after the cached ones is cut into messages: block order
    (positions counted from the first block that travels) and runs of consecutive blocks."""
    transfer_secret: bytes = field(repr=False)
    """``TRANSFER_SECRET_BYTES`` random bytes the UCX tags of the transfer's messages derive
    from (``plan.message_tag``); never logged."""

    num_cached_blocks: int = 0
    """The prompt's first blocks, which the decode worker already holds: their KV does not
    travel."""

    def __post_init__(self) -> None:
        if self.num_cached_blocks < 0:
            raise InvalidRequestError(
                f"{self.num_cached_blocks} cached blocks in a reservation", "target"
            )
        _check_secret(self.transfer_secret, "target")

    @property
    def num_blocks(self) -> int:
        return self.plan.num_blocks


@dataclass(frozen=True)
class CachedKvPull:
    """A prefill worker's request for KV the decode worker already holds (``PushCachedKv``):
    blocks ``first_block .. first_block + plan.num_blocks`` of the prompt of reservation
    ``transfer_id`` (all within its ``num_cached_blocks``), sent as ``plan`` cuts them."""

    transfer_id: int
    """The decode worker's open reservation (``KvReservation.transfer_id``)."""
    request_id: str
    first_block: int
    """The prompt's first block asked for; the ones before it the prefill worker holds."""
    transport_address: bytes
    """The prefill worker's transport address, opaque: where the messages go."""
    plan: TransferPlan
    """How the prefill worker's buffer takes the messages (positions counted from
    ``first_block``)."""
    transfer_secret: bytes = field(repr=False)
    """``TRANSFER_SECRET_BYTES`` random bytes the prefill worker drew; the tags derive from
    them (``plan.message_tag``); never logged."""
    compat_hash: str = ""
    """The prefill worker's KV layout hash; the decode worker's must be equal."""

    def __post_init__(self) -> None:
        if self.first_block < 0:
            raise InvalidRequestError(f"first block {self.first_block}", "first_block")
        _check_secret(self.transfer_secret, "transfer_secret")

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
    after the prompt, that token's logprobs when the request asked for them, how much of
    the prompt its prefix cache served (the decode stream reports it in its usage), and the
    prompt's logprobs when the request asked for them (``StepOutput.prompt_logprobs``)."""

    token_id: int
    logprob: TokenLogprob | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: tuple[TokenLogprob, ...] = ()

    def check(self, vocab_size: int, num_prompt_tokens: int) -> None:
        """Raise ``InvalidRequestError`` naming the field unless every id is a token of a
        ``vocab_size`` vocabulary, the cached count lies in ``[0, num_prompt_tokens]`` and
        prompt logprobs, if any, are one per prompt token after the first."""
        if not 0 <= self.token_id < vocab_size:
            raise InvalidRequestError(
                f"first token id {self.token_id} is outside [0, {vocab_size})", "first_token_id"
            )
        if not 0 <= self.num_cached_tokens <= num_prompt_tokens:
            raise InvalidRequestError(
                f"{self.num_cached_tokens} cached tokens of a {num_prompt_tokens}-token prompt",
                "num_cached_tokens",
            )
        if self.logprob is not None:
            _check_logprob(self.logprob, self.token_id, vocab_size)
        if self.prompt_logprobs:
            if len(self.prompt_logprobs) != num_prompt_tokens - 1:
                raise InvalidRequestError(
                    f"{len(self.prompt_logprobs)} prompt logprobs for a "
                    f"{num_prompt_tokens}-token prompt",
                    "prompt_logprobs",
                )
            for record in self.prompt_logprobs:
                _check_logprob(record, record.token_id, vocab_size, "prompt_logprobs")


def _check_secret(secret: bytes, param: str) -> None:
    """A peer's transfer secret must have ``TRANSFER_SECRET_BYTES`` bytes."""
    if len(secret) != TRANSFER_SECRET_BYTES:
        raise InvalidRequestError(
            f"a transfer secret has {TRANSFER_SECRET_BYTES} bytes, not {len(secret)}", param
        )


def _check_logprob(
    logprob: TokenLogprob, token_id: int, vocab_size: int, param: str = "first_logprob"
) -> None:
    """A logprob record must describe ``token_id``, a token of the vocab, with at most
    ``MAX_LOGPROBS`` top ids in the vocab and a rank of at least 1."""
    top_ids = [top_id for top_id, _ in logprob.top]
    if logprob.token_id != token_id or logprob.rank < 1 or not 0 <= token_id < vocab_size:
        raise InvalidRequestError(
            f"logprob of token {logprob.token_id} (rank {logprob.rank}) for token {token_id}",
            param,
        )
    if len(top_ids) > MAX_LOGPROBS or any(not 0 <= top_id < vocab_size for top_id in top_ids):
        raise InvalidRequestError(
            f"more than {MAX_LOGPROBS} top logprobs, or ids outside [0, {vocab_size})", param
        )
