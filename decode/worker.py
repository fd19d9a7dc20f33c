"""The decode worker's domain: run requests on the local engine, receive pushed KV.

A request arrives either for local prefill (colocated mode, fallback, resume) or with
``remote=True``: then blocks are reserved at once, a ``LayerReceiver`` is posted for the
prompt's layers, and the caller gets a ``KvReservation`` (the transfer descriptor) before any
token. The prefill worker pushes the layers and calls ``complete_kv`` with the first token,
which waits until the last layer landed and lets the request join the running batch; the
first token then opens the request's output stream like any other token.

The KV lands in the reserved blocks: one message per group of layers (at least
``destination.MIN_MESSAGE_BYTES`` for this worker's device, the plan it sends says how many),
received into a small staging ring and copied into them (``transfer/layer_channel.py``,
``KvDestination``). A reservation
starts with the longest prefix of the prompt this worker's prefix cache holds (a
conversation's earlier turns, decoded here; ``Scheduler.reserve_for_remote_prefill``): those
blocks are shared, not written, and the reservation tells the prefill worker to send only the
blocks after them (``KvReservation.num_cached_blocks``).

Transfers nobody else can write into: each reservation gets a random 64-bit transfer id (names
it in ``CompleteKv`` and logs) and a 128-bit secret from the CSPRNG (``new_transfer_secret``),
sent only in the reservation; every UCX tag of the transfer derives from the secret
(``plan.message_tag``), and the receiver checks each message's size against its planned
layer (a canary, ``transfer/canary.py``), so a forged, stale or short message never counts as
landed KV.

Peer input: ``complete_kv`` accepts a first token only for the open transfer of that request
(transfer id and request id both match) and only within bounds (``FirstToken.check``: token id
in the vocabulary, cached tokens within the prompt). A bad one fails that request alone with
``InvalidRequestError`` naming the field: its transfer stops, its blocks go back once settled,
and the running batch never sees the token.

Prefix cache: received KV enters it only through ``Scheduler.complete_remote_prefill``
(``cache_full_blocks``), which ``complete_kv`` reaches only after the transfer completed
(``LayerReceiver.wait``: every message landed with its planned size) and the prefill side's
``CompleteKv`` passed the checks above. Reserved blocks carry no prefix hash until then (the
pool evicts a block's hash when it hands the block out), so no other request can hit KV that
is still arriving or that came from a failed or aborted transfer.

The reverse transfer: while a reservation is open, the prefill worker computing its prompt
may ask for KV of the reservation's cached blocks that its own prefix cache lacks
(``push_cached_kv``, a ``CachedKvPull``): they are gathered (held, full, never written: on the
event loop for a host-memory cache, on the engine thread for a GPU one) into a staging
buffer and sent over the transport into the prefill worker's buffer, by its plan and under
tags of its secret. Only the cached blocks of an open transfer, of the request it names,
ever leave this way.

Invariant: a reserved block goes back to the pool only once its receiver settled (nothing of
the transfer can write into blocks that were handed to another request), on every exit path:
stream closed by the caller, ``abort``, transfer failure, a failed engine step. The engine
takes a *hold* (an extra reference) on the reserved blocks in the same command that reserves
them; the request may end at any time, and the transfer gives the hold back once its receiver
settled. Blocks of receives that never settle never return to the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from splitserve.common.errors import (
    EngineStoppedError,
    IncompatibleKvLayoutError,
    InvalidRequestError,
)
from splitserve.common.event_wait import wait_event
from splitserve.common.kv_layout import KvLayout
from splitserve.common.kv_push_cost import NO_PUSH_COSTS, KvPushCosts
from splitserve.common.request_update import StepOutput
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.async_engine import AsyncEngine, RequestStream
from splitserve.engine.engine_face import ReservedBlocks
from splitserve.transfer.destination import KvDestination, min_message_bytes
from splitserve.transfer.layer_channel import LayerReceiver, LayerSender
from splitserve.transfer.plan import new_transfer_secret
from splitserve.transfer.reservation import CachedKvPull, FirstToken, KvReservation
from splitserve.transfer.transport import KvTransport
from splitserve.worker.identity import WorkerIdentity
from splitserve.worker.kv_io import gather_layer, kv_layout_of, staging_buffer
from splitserve.worker.metrics import TransferMetrics
from splitserve.worker.transfer_settings import TransferSettings

logger = logging.getLogger(__name__)

PREVIOUS_ATTEMPT_WAIT_S = 1.0
"""How long a retried request id waits for its previous attempt here to end: the same
coordinator's cancellation arrives within milliseconds; this stays below the coordinator's
stall limit (``coordinator/stall_limits.py``, at least 2 s), so a retry superseding a stale
attempt is not itself called stalled."""


@dataclass
class _Attempt:
    """One open ``generate`` of a request id: ``ended`` once its iterator closed;
    ``superseded`` once a newer attempt of the id took its place (``_supersede``)."""

    ended: asyncio.Event = field(default_factory=asyncio.Event)
    superseded: bool = False


@dataclass
class _Incoming:
    request_id: str
    receiver: LayerReceiver
    block_ids: list[int]
    num_bytes: int
    num_prompt_tokens: int
    num_cached_blocks: int
    """``block_ids``' leading blocks that came from the prefix cache (``push_cached_kv``
    sends only those)."""
    reserved_at: float = field(default_factory=time.monotonic)


class DecodeWorker:
    """Owns the engine, the KV receivers and the transfer ids of one decode worker."""

    def __init__(
        self,
        engine: AsyncEngine,
        transport: KvTransport,
        identity: WorkerIdentity,
        transfer: TransferSettings,
    ) -> None:
        """``engine``: this worker's engine (a dual-role worker's prefill domain shares it)."""
        self.identity = identity
        self.engine = engine
        self.transport = transport
        self.layout: KvLayout = kv_layout_of(engine.facts, engine.paged_kv)
        self.transfer_timeout_s = transfer.timeout_s
        self.kv_message_bytes = transfer.min_message_bytes  # None: by the cache's device
        self.pulls_cached_kv_min_blocks = 0  # it is the one pulled from
        self._incoming: dict[int, _Incoming] = {}
        self._transfer_of: dict[str, int] = {}
        self._settling: set[asyncio.Task[None]] = set()  # stopped receivers holding blocks
        self._open_attempts: dict[str, _Attempt] = {}  # request id -> its open attempt
        self.transfer_metrics = TransferMetrics()

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        remote_prefill: bool,
        prior_output_token_ids: Sequence[int] = (),
    ) -> AsyncIterator[KvReservation | StepOutput]:
        """Run one request; with ``remote_prefill`` first yield its ``KvReservation``.
        ``prior_output_token_ids``: a resumed request's earlier tokens
        (``AsyncEngine.submit``); only what follows them is yielded.

        Closing the iterator early aborts the request and frees its blocks. A new attempt of a
        request id whose previous attempt is still open here (the coordinator retried before
        the previous attempt's cancellation arrived) waits up to ``PREVIOUS_ATTEMPT_WAIT_S``
        for it to end; one still open then supersedes it (``_supersede``): its caller can no
        longer reach this worker (a coordinator cut off from it, whose stream another
        coordinator took over), so the newest attempt is the one a client is reading.
        """
        await self._previous_attempt_ended(request_id)
        # registered before the submit (no await in between): a concurrent retry of the id
        # waits for this attempt instead of reaching the engine as a duplicate
        attempt = self._open_attempts[request_id] = _Attempt()
        try:
            stream = await self._submit(
                request_id, prompt_token_ids, params, remote_prefill, prior_output_token_ids
            )
            try:
                if stream.reserved is not None:
                    yield self._expect_kv(request_id, stream.reserved, len(prompt_token_ids))
                async for output in stream:
                    yield output
            finally:
                if not attempt.superseded:  # else the id is the newer attempt's now
                    self._stop_receiving(request_id)
                    self.engine.abort(request_id)  # no-op when the request already finished
        finally:
            attempt.ended.set()  # the abort above is queued: a retry's submit lands after it
            if self._open_attempts.get(request_id) is attempt:
                del self._open_attempts[request_id]

    async def _previous_attempt_ended(self, request_id: str) -> None:
        """Return once no attempt of ``request_id`` is open here: each open one is waited
        for up to ``PREVIOUS_ATTEMPT_WAIT_S``, then superseded."""
        while (previous := self._open_attempts.get(request_id)) is not None:
            ended = await wait_event(previous.ended, PREVIOUS_ATTEMPT_WAIT_S)
            if not ended and self._open_attempts.get(request_id) is previous:
                self._supersede(request_id, previous)

    def _supersede(self, request_id: str, previous: _Attempt) -> None:
        """End ``previous`` (an attempt its caller never closed) in favour of a new attempt
        of the same request id: its receive is stopped and the engine's request aborted now
        (queued before the new attempt's submit), and its iterator, whenever it is closed,
        leaves the id alone."""
        logger.warning(
            "request %s: a new attempt supersedes one whose caller did not close it in %g s",
            request_id,
            PREVIOUS_ATTEMPT_WAIT_S,
        )
        previous.superseded = True
        self._stop_receiving(request_id)
        self.engine.abort(request_id)
        del self._open_attempts[request_id]

    async def _submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        remote_prefill: bool,
        prior_output_token_ids: Sequence[int],
    ) -> RequestStream:
        """Queue the request; a reservation that does not fit now waits, in arrival order,
        until blocks free up (``ReservationQueue``: no polling). Requests that can never fit
        are refused by the engine at once; ``CapacityError`` when too many already wait."""
        started = time.monotonic()
        stream = await self.engine.submit(
            request_id,
            prompt_token_ids,
            params,
            reserve_remote_prefill=remote_prefill,
            prior_output_token_ids=prior_output_token_ids,
        )
        if remote_prefill:
            self.transfer_metrics.reservation_wait.observe(time.monotonic() - started)
        return stream

    def _expect_kv(
        self, request_id: str, reserved: ReservedBlocks, num_tokens: int
    ) -> KvReservation:
        """Post the receiver for a reservation: into the blocks after its cached prefix
        (``ReservedBlocks.receiving``); from here the transfer owns the hold the engine took
        on all of ``reserved.block_ids`` (``AsyncEngine.submit``)."""
        block_ids = list(reserved.block_ids)
        transfer_id, secret = self._new_transfer_id(), new_transfer_secret()
        try:
            # the new blocks: no step touches them until the prefill completes (PagedKv)
            cache = self.engine.paged_kv.cache
            group_bytes = min_message_bytes(cache.device, self.kv_message_bytes)
            destination = KvDestination(cache, reserved.receiving, group_bytes)
            plan = destination.plan
            receiver = LayerReceiver(self.transport, transfer_id, secret, destination)
        except BaseException:
            self.engine.release_blocks(block_ids)  # no receive was posted
            raise
        self.transfer_metrics.block_runs.observe(plan.num_runs)
        self.transfer_metrics.cached_blocks.inc(reserved.num_cached_blocks)
        num_bytes = self.layout.layer_bytes(plan.num_blocks) * self.layout.num_layers
        incoming = _Incoming(
            request_id, receiver, block_ids, num_bytes, num_tokens, reserved.num_cached_blocks
        )
        self._incoming[transfer_id] = incoming
        self._transfer_of[request_id] = transfer_id
        return KvReservation(
            transfer_id,
            self.identity.address,
            num_tokens,
            self.layout.compat_hash,
            plan,
            secret,
            num_cached_blocks=reserved.num_cached_blocks,
        )

    def _new_transfer_id(self) -> int:
        """A random 64-bit id no open transfer here has (ids are not secrets; see the module
        docstring)."""
        while (transfer_id := secrets.randbits(64)) in self._incoming:
            pass
        return transfer_id

    async def complete_kv(self, transfer_id: int, request_id: str, first: FirstToken) -> None:
        """Wait for every layer of the transfer, then start decoding the request with the
        prefill worker's first token (it goes out on the request's stream).

        Raises ``InvalidRequestError`` for an unknown transfer, and, naming the field, for a
        first token out of bounds (``FirstToken.check``; the request is then aborted and its
        blocks go back once its receives settled); ``TransferError`` subclasses when the KV
        does not arrive in time or a message is not its planned size (the request is then
        aborted). Other requests are never affected.
        """
        incoming = self._incoming.get(transfer_id)
        if incoming is None or incoming.request_id != request_id:
            raise InvalidRequestError(
                f"no KV reservation {transfer_id} for request {request_id!r}", "transfer_id"
            )
        try:
            first.check(self.engine.facts.vocab_size, incoming.num_prompt_tokens)
        except InvalidRequestError:
            await self.abort(request_id)
            raise
        try:
            await incoming.receiver.wait(self.transfer_timeout_s)
        except BaseException as error:
            self.transfer_metrics.failed("receive", error)
            await self.abort(request_id)
            raise
        self.transfer_metrics.completed(
            "receive", incoming.num_bytes, time.monotonic() - incoming.reserved_at
        )
        if self._take(request_id) is incoming:  # else a concurrent stop released the hold
            self.engine.release_blocks(incoming.block_ids)  # every receive settled: DONE
        await self.engine.complete_remote_prefill(
            request_id,
            first.token_id,
            first.logprob,
            first.num_cached_tokens,
            first.prompt_logprobs,
        )

    async def push_cached_kv(self, pull: CachedKvPull) -> int:
        """Send the KV of cached blocks of an open reservation where ``pull`` says (the
        reverse transfer, module docstring); returns the bytes sent, once all were.

        Raises ``IncompatibleKvLayoutError`` for another KV layout; ``InvalidRequestError``
        naming the field for a transfer not open here for that request, or blocks beyond its
        cached ones; ``TransferError`` subclasses when the sends fail or time out. The
        reservation itself is never affected.
        """
        if pull.compat_hash != self.layout.compat_hash:
            raise IncompatibleKvLayoutError(
                "the prefill worker's KV layout hash differs from this decode worker's "
                f"({pull.compat_hash} != {self.layout.compat_hash})"
            )
        pull.plan.check_groups(self.layout.num_layers, "layers_per_message")
        endpoint = await self.transport.connect(pull.transport_address)
        # From here to the gather (or its engine command), nothing awaits: a stop of the transfer
        # (``_stop_receiving``) queues the hold's release after the gather.
        incoming = self._incoming.get(pull.transfer_id)
        if incoming is None or incoming.request_id != pull.request_id:
            raise InvalidRequestError(
                f"no KV reservation {pull.transfer_id} for request {pull.request_id!r}",
                "transfer_id",
            )
        end = pull.first_block + pull.num_blocks
        if end > incoming.num_cached_blocks:
            raise InvalidRequestError(
                f"blocks {pull.first_block}..{end} asked for; the reservation holds "
                f"{incoming.num_cached_blocks} cached",
                "first_block",
            )
        block_ids = incoming.block_ids[pull.first_block : end]
        paged_kv, num_layers = self.engine.paged_kv, self.layout.num_layers
        loop = asyncio.get_running_loop()
        sender = LayerSender(
            endpoint, pull.transfer_id, pull.transfer_secret, num_layers, pull.plan, loop
        )
        staging = staging_buffer(paged_kv, pull.num_blocks)

        def gather() -> None:  # held blocks: here, or on the engine thread (a GPU cache)
            for layer in range(num_layers):
                kv = gather_layer(paged_kv, layer, block_ids, pull.plan, staging[layer])
                sender.offer(layer, kv)

        started = time.monotonic()
        try:
            if paged_kv.reads_held_blocks_anywhere:
                gather()  # no wait for the running step; before any release can be queued
            else:
                await self.engine.call(gather)
            num_bytes = await sender.finish(self.transfer_timeout_s)
        except BaseException as error:
            sender.abort()
            self.transfer_metrics.failed("send", error)
            raise
        self.transfer_metrics.completed("send", num_bytes, time.monotonic() - started)
        return num_bytes

    async def abort(self, request_id: str, as_stopped: bool = False) -> bool:
        """End a request (ABORT, or STOP when a stop string matched); False if unknown."""
        self._stop_receiving(request_id)
        known = await self.engine.has_request(request_id)
        if as_stopped:
            self.engine.finish(request_id)
        else:
            self.engine.abort(request_id)
        return known

    def _stop_receiving(self, request_id: str) -> None:
        """Stop the request's transfer, if any, and give back its hold on the reserved
        blocks once no message can land in them any more.

        Synchronous, so that the caller's ``engine.abort`` follows at once: a retry of the same
        request id may arrive right after, and must not be hit by a late abort. The request
        may end at once: the hold, not the request, keeps the blocks out of the pool.
        """
        incoming = self._take(request_id)
        if incoming is None:
            return
        if incoming.receiver.settled:
            self.engine.release_blocks(incoming.block_ids)
            return
        task = asyncio.get_running_loop().create_task(self._release_when_settled(incoming))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _release_when_settled(self, incoming: _Incoming) -> None:
        """Stop the receiver; give back the hold once every receive settled. Blocks of
        receives still in flight after the withdrawal stay out of the pool until they settle
        (for good, if they never do)."""
        receiver = incoming.receiver
        await receiver.abort()
        if not receiver.settled:
            num_blocks = len(incoming.block_ids)
            logger.error(
                "transfer %d: receives in flight after withdrawal; its %d KV blocks stay out "
                "of the pool until they settle",
                receiver.transfer_id,
                num_blocks,
            )
            unsettled = self.transfer_metrics.unsettled_blocks
            unsettled.inc(num_blocks)
            try:
                await receiver.until_settled()
            finally:
                unsettled.dec(num_blocks)
            logger.info("transfer %d settled: %d KV blocks back", receiver.transfer_id, num_blocks)
        with contextlib.suppress(EngineStoppedError):  # shut down meanwhile: nothing to free
            self.engine.release_blocks(incoming.block_ids)

    def _take(self, request_id: str) -> _Incoming | None:
        """Remove and return the request's transfer: its taker gives back the hold."""
        transfer_id = self._transfer_of.pop(request_id, None)
        return None if transfer_id is None else self._incoming.pop(transfer_id, None)

    def kv_push_costs(self) -> KvPushCosts:
        """None: a decode worker pushes no prompt's KV (it is pushed to)."""
        return NO_PUSH_COSTS

    def handshake(self, peer: KvLayout) -> KvLayout:
        """Raise ``IncompatibleKvLayoutError`` unless ``peer`` may push KV here."""
        self.layout.check_compatible(peer)
        return self.layout

    async def close(self) -> None:
        """Stop settling transfers; the engine is its creator's to shut down."""
        for task in self._settling:
            task.cancel()
