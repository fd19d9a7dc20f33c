"""The prefill worker's domain: compute prompts, push their KV layer by layer, sample token 1.

``prefill`` handshakes with the target decode worker once per peer (KV layout check, UCX
address), registers a ``LayerSender`` for the request and submits it to the engine with
``max_tokens=1``. The engine batches it with other prompts under its token budget and chunks
long ones; in the step that computes the prompt's last chunk the engine reports the prompt
complete (``CompletedPrompt``), and the layer hook copies each layer's KV of the request (its
blocks after those the decode worker already holds, ``KvReservation.num_cached_blocks``; this
worker's own cached prefix included, in the order of the decode worker's ``TransferPlan``)
into the request's staging buffer as soon as that layer is written and hands it to the
sender, so the push overlaps the rest of the forward pass. Then it waits
for the sends and calls the decode worker's ``CompleteKv`` with the first token (the decode
worker streams it); once that returns (the KV landed) the staging buffer is dropped and
``PrefillDone`` is returned. Calls to decode workers go through ``proto.worker_clients``.

The engine's own blocks go back to its pool (and prefix cache) when the request finishes:
only the staging buffer waits for the decode worker's confirmation.

Pulling cached KV (the reverse transfer): when the decode worker's reservation says it holds
more of the prompt's leading blocks (``KvReservation.num_cached_blocks``, e.g. a
conversation's last reply, decoded there) than this worker's prefix cache does, by at least
``TransferSettings.pull_min_blocks``, ``prefill`` first reserves blocks for the difference
(``AsyncEngine.reserve_pulled_prefix``), posts a ``LayerReceiver`` into them under a secret
of its own and asks the decode worker to send them (``PushCachedKv``, a ``CachedKvPull``).
Once every message landed with its planned size, the blocks enter the prefix cache
(``end_pulled_prefix``) and the prompt is submitted: the engine computes only the tokens
after them. A pull that fails or times out costs only time: its blocks stay out of the pool
until its receives settled, enter no cache, and the prompt is computed as without it (never
a wrong token). The hold on the pulled blocks lasts until the prompt is computed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from opentelemetry.trace import Span, StatusCode

from splitserve.common.blocks import blocks_for_tokens
from splitserve.common.errors import (
    EngineStoppedError,
    IncompatibleKvLayoutError,
    InvalidRequestError,
    TransferAbortedError,
    TransferError,
    WorkerCallError,
    WorkerUnavailableError,
)
from splitserve.common.kv_layout import KvLayout
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.tracing import NO_SPAN, start_span
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.engine_face import CompletedPrompt, ReservedBlocks
from splitserve.proto.worker_clients import DecodeWorkerClient, WorkerChannels
from splitserve.transfer.layer_channel import LayerReceiver, LayerSender
from splitserve.transfer.plan import new_transfer_secret
from splitserve.transfer.reservation import CachedKvPull, FirstToken, KvReservation, PrefillDone
from splitserve.transfer.transport import KvEndpoint, KvTransport
from splitserve.worker.identity import WorkerIdentity
from splitserve.worker.kv_io import (
    gather_layer,
    kv_layout_of,
    receive_destinations,
    staging_buffer,
)
from splitserve.worker.metrics import TransferMetrics
from splitserve.worker.transfer_settings import TransferSettings

logger = logging.getLogger(__name__)


@dataclass
class _Outgoing:
    sender: LayerSender
    first_block: int
    """The prompt's first block that travels (the decode worker holds those before it)."""
    staging: torch.Tensor
    """[layers, 2, num_blocks, block, kv_heads, dim]: the gathered KV the sends read from."""
    gathered: set[int] = dataclasses.field(default_factory=set)
    """Layers already gathered (engine thread only): a layer is never rewritten while its
    messages may be in flight."""


PEER_IDLE_S = 600.0
"""A link to a decode worker unused this long is dropped (scaled down, replaced); the next
prompt for it, if any, handshakes again."""


@dataclass
class _Peer:
    client: DecodeWorkerClient
    endpoint: KvEndpoint
    transfer_address: bytes
    """The decode worker's transport address (from the handshake)."""
    last_used: float = dataclasses.field(default_factory=time.monotonic)


class PrefillWorker:
    """Owns the engine, the outgoing transfers and the links to decode workers."""

    def __init__(
        self,
        engine: AsyncEngine,
        transport: KvTransport,
        identity: WorkerIdentity,
        transfer: TransferSettings,
        engine_shared: bool = False,
    ) -> None:
        """``engine``: this worker's engine; its layer hook becomes this domain's KV push.
        ``engine_shared``: a decode domain runs requests on the same engine (a dual-role
        worker), so this domain's requests take engine ids of their own (the request id plus
        ``_engine_id_suffix``): a prompt prefilled here for another decode worker never
        collides with a request of the same id decoding here."""
        self.identity = identity
        self.engine = engine
        engine.set_layer_hook(self._push_layer)
        self._engine_id_suffix = " prefill" if engine_shared else ""
        self.transport = transport
        self.layout: KvLayout = kv_layout_of(engine.facts, engine.paged_kv)
        self.transfer_timeout_s = transfer.timeout_s
        self.pulls_cached_kv_min_blocks = transfer.pull_min_blocks
        self._outgoing: dict[str, _Outgoing] = {}
        self._peers: dict[str, _Peer] = {}
        if identity.access is None:
            raise ValueError("a prefill worker calls decode workers: it needs cluster access")
        self._channels = WorkerChannels(identity.access)
        self._peer_locks: dict[str, asyncio.Lock] = {}
        self._settling: set[asyncio.Task[None]] = set()  # failed pulls' receives settling
        self.transfer_metrics = TransferMetrics()

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        target: KvReservation,
        span: Span = NO_SPAN,
    ) -> PrefillDone:
        """Compute, push, hand over the first token; see the module docstring. Cancelling
        aborts everything. ``span``: the request's here, under which the computing and the
        end of the push are spans of their own (``common/tracing.py``)."""
        peer = await self._peer(target.decode_address)  # the handshake checks KV layouts
        self._check_target(prompt_token_ids, target)
        engine_id = request_id + self._engine_id_suffix
        pulled = await self._pull_cached_kv(request_id, prompt_token_ids, target, peer, span)
        try:
            return await self._compute_and_push(
                request_id, engine_id, prompt_token_ids, params, target, peer, span
            )
        finally:
            if pulled is not None:
                self.engine.release_blocks(pulled)

    async def _compute_and_push(
        self,
        request_id: str,
        engine_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        target: KvReservation,
        peer: _Peer,
        span: Span,
    ) -> PrefillDone:
        loop = asyncio.get_running_loop()
        sender = LayerSender(
            peer.endpoint,
            target.transfer_id,
            target.transfer_secret,
            self.layout.num_layers,
            target.plan,
            loop,
        )
        staging = staging_buffer(self.engine.paged_kv, target.num_blocks)
        self._outgoing[engine_id] = _Outgoing(sender, target.num_cached_blocks, staging)
        first_only = dataclasses.replace(
            params, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=()
        )
        compute = start_span("prefill compute", request_id, parent=span)
        push = NO_SPAN
        try:
            last = None
            async for output in self.engine.generate(engine_id, list(prompt_token_ids), first_only):
                last = output
            compute.set_attribute("splitserve.prompt_tokens", len(prompt_token_ids))
            compute.end()
            if last is None or not last.update.new_token_ids:
                raise TransferAbortedError(f"request {request_id!r} was aborted during prefill")
            push = start_span("kv push", request_id, parent=span)
            push.set_attribute("splitserve.kv_blocks", target.num_blocks)
            push.set_attribute("splitserve.kv_cached_blocks", target.num_cached_blocks)
            push.set_attribute("splitserve.kv_layers", self.layout.num_layers)
            push.set_attribute("splitserve.kv_bytes", await self._finish_sends(sender))
            num_cached_tokens = last.update.num_cached_tokens
            first = FirstToken(
                last.update.new_token_ids[0],
                last.logprobs[0] if last.logprobs else None,
                num_cached_tokens,
            )
            await peer.client.complete_kv(target, request_id, first, self.transfer_timeout_s)
        except (TransferError, WorkerUnavailableError, WorkerCallError) as error:
            self._forget_peer(target.decode_address)  # it may have restarted: handshake again
            push.set_status(StatusCode.ERROR, type(error).__name__)
            raise
        finally:
            sender.abort()  # no-op once DONE
            self._outgoing.pop(engine_id, None)
            for part in (compute, push):
                if part.is_recording():  # not ended yet: the request failed in it
                    part.end()
        return PrefillDone(num_cached_tokens)

    async def _pull_cached_kv(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        target: KvReservation,
        peer: _Peer,
        span: Span,
    ) -> tuple[int, ...] | None:
        """Receive the decode worker's cached blocks of the prompt that this engine's prefix
        cache lacks, into blocks reserved here, and enter them into that cache (module
        docstring). Returns the blocks to give the hold back on once the prompt is computed;
        None when nothing was pulled (too little to gain, no room, or the pull failed: the
        prompt is then computed as without it)."""
        wanted = target.num_cached_blocks
        if not self.pulls_cached_kv_min_blocks or wanted < self.pulls_cached_kv_min_blocks:
            return None
        key = f"\x00pull {request_id}{self._engine_id_suffix}"  # no request id has a NUL
        reserved = await self.engine.reserve_pulled_prefix(
            key, prompt_token_ids, wanted, self.pulls_cached_kv_min_blocks
        )
        if reserved is None:
            return None
        prefix = prompt_token_ids[: wanted * self.layout.block_size]
        span_pull = start_span("kv pull", request_id, parent=span)
        span_pull.set_attribute("splitserve.kv_blocks", len(reserved.receiving))
        started = time.monotonic()
        receiver: LayerReceiver | None = None
        try:
            plan, destinations = receive_destinations(
                self.engine.paged_kv.cache, reserved.receiving
            )
            secret = new_transfer_secret()
            receiver = LayerReceiver(
                self.transport, secrets.randbits(64), secret, plan, destinations
            )
            pull = CachedKvPull(
                target.transfer_id,
                request_id,
                reserved.num_cached_blocks,
                self.transport.address,
                plan,
                secret,
                self.layout.compat_hash,
            )
            await peer.client.push_cached_kv(pull, self.transfer_timeout_s)
            await receiver.wait(self.transfer_timeout_s)
        except (
            TransferError,
            WorkerUnavailableError,
            WorkerCallError,
            InvalidRequestError,
        ) as error:
            self.transfer_metrics.failed("receive", error)
            span_pull.set_status(StatusCode.ERROR, type(error).__name__)
            span_pull.end()
            logger.warning(
                "request %r: pulling cached KV failed (%s); computing it", request_id, error
            )
            self._drop_pull(key, prefix, reserved, receiver)
            return None
        except BaseException:
            span_pull.end()
            self._drop_pull(key, prefix, reserved, receiver)
            raise
        num_bytes = self.layout.layer_bytes(plan.num_blocks) * self.layout.num_layers
        self.transfer_metrics.completed("receive", num_bytes, time.monotonic() - started)
        self.transfer_metrics.pulled_blocks.inc(plan.num_blocks)
        span_pull.set_attribute("splitserve.kv_bytes", num_bytes)
        span_pull.end()
        self.engine.end_pulled_prefix(key, prefix, landed=True)
        return reserved.block_ids

    def _drop_pull(
        self,
        key: str,
        prefix: Sequence[int],
        reserved: ReservedBlocks,
        receiver: LayerReceiver | None,
    ) -> None:
        """A pull that did not land: its table ends uncached, and its hold is given back once
        no message can land in its blocks any more (never, if a receive never settles)."""
        self.engine.end_pulled_prefix(key, prefix, landed=False)
        if receiver is None or receiver.settled:
            self.engine.release_blocks(reserved.block_ids)
            return
        task = asyncio.get_running_loop().create_task(
            self._release_when_settled(receiver, reserved)
        )
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _release_when_settled(
        self, receiver: LayerReceiver, reserved: ReservedBlocks
    ) -> None:
        await receiver.abort()
        await receiver.until_settled()
        with contextlib.suppress(EngineStoppedError):  # shut down meanwhile: nothing to free
            self.engine.release_blocks(reserved.block_ids)

    async def _finish_sends(self, sender: LayerSender) -> int:
        """Wait until every layer was sent (the prompt is computed); record the transfer;
        the bytes sent."""
        computed = time.perf_counter()
        try:
            bytes_sent = await sender.finish(self.transfer_timeout_s)
        except BaseException as error:
            self.transfer_metrics.failed("send", error)
            raise
        self.transfer_metrics.completed("send", bytes_sent, time.perf_counter() - computed)
        return bytes_sent

    def _check_target(self, prompt_token_ids: Sequence[int], target: KvReservation) -> None:
        if target.compat_hash != self.layout.compat_hash:
            raise IncompatibleKvLayoutError(
                "the decode worker's KV layout hash differs from this prefill worker's "
                f"({target.compat_hash} != {self.layout.compat_hash})"
            )
        expected = blocks_for_tokens(len(prompt_token_ids), self.layout.block_size)
        sent, cached = target.num_blocks, target.num_cached_blocks
        if target.num_tokens != len(prompt_token_ids) or sent < 1 or cached + sent != expected:
            raise InvalidRequestError(
                f"reservation covers {target.num_tokens} tokens / {cached} cached + {sent} "
                f"blocks to send, prompt has {len(prompt_token_ids)} tokens / {expected} blocks",
                "target",
            )

    def _push_layer(self, layer: int, completed: Sequence[CompletedPrompt]) -> None:
        """Engine thread: hand each completed prompt's KV of ``layer`` to its sender."""
        for prompt in completed:
            outgoing = self._outgoing.get(prompt.request_id)
            if outgoing is None or layer in outgoing.gathered:
                continue
            outgoing.gathered.add(layer)
            plan = outgoing.sender.plan
            first = outgoing.first_block
            block_ids = prompt.block_table[first : first + plan.num_blocks]
            kv = gather_layer(self.engine.paged_kv, layer, block_ids, plan, outgoing.staging[layer])
            outgoing.sender.offer(layer, kv)

    async def _peer(self, address: str) -> _Peer:
        """The handshaken link to a decode worker (created once per address; links idle for
        ``PEER_IDLE_S`` are dropped here, with their locks and channels)."""
        await self._drop_idle_peers(time.monotonic())
        lock = self._peer_locks.setdefault(address, asyncio.Lock())
        async with lock:
            peer = self._peers.get(address)
            if peer is not None:
                peer.last_used = time.monotonic()
                return peer
            client = self._channels.decode(address)
            try:
                reply = await client.handshake(self.layout, self.transfer_timeout_s)
            except (WorkerUnavailableError, WorkerCallError) as error:
                raise TransferError(f"KV handshake with {address} failed: {error}") from None
            if reply.transport != self.transport.name:
                raise IncompatibleKvLayoutError(
                    f"decode worker {address} transfers KV over {reply.transport!r}, "
                    f"this prefill worker over {self.transport.name!r}"
                )
            endpoint = await self.transport.connect(reply.transport_address)
            peer = _Peer(client, endpoint, reply.transport_address)
            self._peers[address] = peer
            return peer

    def _forget_peer(self, address: str) -> None:
        """After a failed transfer: handshake and reconnect on next use (it may have restarted)."""
        peer = self._peers.pop(address, None)
        if peer is not None:
            self.transport.forget(peer.transfer_address)
        lock = self._peer_locks.get(address)
        if lock is not None and not lock.locked():
            del self._peer_locks[address]

    async def _drop_idle_peers(self, now: float) -> None:
        idle = [a for a, peer in self._peers.items() if now - peer.last_used > PEER_IDLE_S]
        for address in idle:
            self._forget_peer(address)
        if idle:
            await self._channels.retain(set(self._peers), grace_s=60.0, now=now)

    async def close(self) -> None:
        """Close the links to decode workers; the engine is its creator's to shut down."""
        for task in self._settling:
            task.cancel()
        await self._channels.close()
