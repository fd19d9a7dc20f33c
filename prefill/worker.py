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
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from opentelemetry.trace import Span, StatusCode

from splitserve.common.blocks import blocks_for_tokens
from splitserve.common.errors import (
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
from splitserve.engine.engine_face import CompletedPrompt
from splitserve.proto.worker_clients import DecodeWorkerClient, WorkerChannels
from splitserve.transfer.layer_channel import LayerSender
from splitserve.transfer.reservation import FirstToken, KvReservation, PrefillDone
from splitserve.transfer.transport import KvEndpoint, KvTransport
from splitserve.worker.identity import WorkerIdentity
from splitserve.worker.kv_io import gather_layer, kv_layout_of, staging_buffer
from splitserve.worker.metrics import TransferMetrics


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
        transfer_timeout_s: float,
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
        self.transfer_timeout_s = transfer_timeout_s
        self._outgoing: dict[str, _Outgoing] = {}
        self._peers: dict[str, _Peer] = {}
        if identity.access is None:
            raise ValueError("a prefill worker calls decode workers: it needs cluster access")
        self._channels = WorkerChannels(identity.access)
        self._peer_locks: dict[str, asyncio.Lock] = {}
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
        engine_id = request_id + self._engine_id_suffix
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
        await self._channels.close()
