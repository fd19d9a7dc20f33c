"""The prefill worker's domain: compute prompts, push their KV layer by layer, sample token 1.

``prefill`` handshakes with the target decode worker once per peer (KV layout check, UCX
address), registers a ``LayerSender`` for the request and submits it to the engine with
``max_tokens=1``. The engine batches it with other prompts under its token budget and chunks
long ones; from the step that computes the prompt's last chunk, the layer hook copies each
layer's KV of the request (all its blocks, cached prefix included, in the order of the decode
worker's ``TransferPlan``) into the request's staging buffer as soon as that layer is written
and hands it to the sender, so the push overlaps the rest of the forward pass. Then it waits
for the sends and calls the decode worker's ``CompleteKv``; once that returns (the KV landed)
the staging buffer is dropped and the first token is returned.

The engine's own blocks go back to its pool (and prefix cache) when the request finishes:
only the staging buffer waits for the decode worker's confirmation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import torch

from splitserve.common.blocks import blocks_for_tokens
from splitserve.common.errors import (
    IncompatibleKvLayoutError,
    InvalidRequestError,
    TransferAbortedError,
    TransferError,
)
from splitserve.common.load import EngineLoad
from splitserve.common.logprobs import TokenLogprob
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.scheduler import SchedulerOutput
from splitserve.proto import convert
from splitserve.proto.server import insecure_channel
from splitserve.proto.splitserve.v1 import worker_pb2, worker_pb2_grpc
from splitserve.transfer.layer_channel import LayerSender
from splitserve.transfer.layout import KvLayout
from splitserve.transfer.plan import TransferPlan
from splitserve.transfer.transport import KvEndpoint, KvTransport
from splitserve.worker.identity import WorkerIdentity
from splitserve.worker.kv_io import gather_layer, kv_layout_of, staging_buffer
from splitserve.worker.metrics import TransferMetrics


@dataclass(frozen=True)
class KvTarget:
    """The decode worker's reservation for one request (from its ``KvReservation``)."""

    decode_address: str
    transfer_id: int
    num_blocks: int
    num_tokens: int
    compat_hash: str
    plan: TransferPlan
    """How the decode worker receives the KV: message order and runs of its blocks."""


@dataclass(frozen=True)
class PrefillResult:
    first_token_id: int
    first_logprob: TokenLogprob | None
    num_cached_tokens: int
    prefill_ms: float
    transfer_wait_ms: float
    bytes_sent: int


@dataclass
class _Outgoing:
    sender: LayerSender
    staging: torch.Tensor
    """[layers, 2, num_blocks, block, kv_heads, dim]: the gathered KV the sends read from."""
    gathered: set[int] = dataclasses.field(default_factory=set)
    """Layers already gathered (engine thread only): a layer is never rewritten while its
    messages may be in flight."""


@dataclass
class _Peer:
    stub: worker_pb2_grpc.DecodeWorkerStub
    endpoint: KvEndpoint
    transfer_address: bytes
    """The decode worker's transport address (from the handshake)."""


class PrefillWorker:
    """Owns the engine, the outgoing transfers and the links to decode workers."""

    def __init__(
        self,
        core: EngineCore,
        transport: KvTransport,
        identity: WorkerIdentity,
        transfer_timeout_s: float,
    ) -> None:
        self.core = core
        self.identity = identity
        self.engine = AsyncEngine(core, on_layer_kv_written=self._push_layer)
        self.transport = transport
        self.layout: KvLayout = kv_layout_of(core)
        self.transfer_timeout_s = transfer_timeout_s
        self._outgoing: dict[str, _Outgoing] = {}
        self._peers: dict[str, _Peer] = {}
        self._channels: list[grpc.aio.Channel] = []
        self._peer_locks: dict[str, asyncio.Lock] = {}
        self.transfer_metrics = TransferMetrics()

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        target: KvTarget,
    ) -> PrefillResult:
        """Compute, push, confirm; see the module docstring. Cancelling aborts everything."""
        peer = await self._peer(target.decode_address)  # the handshake checks KV layouts
        self._check_target(prompt_token_ids, target)
        loop = asyncio.get_running_loop()
        sender = LayerSender(
            peer.endpoint, target.transfer_id, self.layout.num_layers, target.plan, loop
        )
        staging = staging_buffer(self.core, target.num_blocks)
        self._outgoing[request_id] = _Outgoing(sender, staging)
        first_only = dataclasses.replace(
            params, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=()
        )
        started = time.perf_counter()
        try:
            last = None
            async for output in self.engine.generate(
                request_id, list(prompt_token_ids), first_only
            ):
                last = output
            if last is None or not last.update.new_token_ids:
                raise TransferAbortedError(f"request {request_id!r} was aborted during prefill")
            computed = time.perf_counter()
            try:
                bytes_sent = await sender.finish(self.transfer_timeout_s)
            except BaseException as error:
                self.transfer_metrics.failed("send", error)
                raise
            self.transfer_metrics.completed("send", bytes_sent, time.perf_counter() - computed)
            first_token_id = last.update.new_token_ids[0]
            complete = worker_pb2.CompleteKvRequest(
                transfer_id=target.transfer_id,
                request_id=request_id,
                first_token_id=first_token_id,
                num_layers_sent=self.layout.num_layers,
            )
            if last.logprobs:
                complete.first_logprob.CopyFrom(convert.logprob_to_proto(last.logprobs[0]))
            await peer.stub.CompleteKv(complete, timeout=self.transfer_timeout_s)
        except TransferError:
            self._forget_peer(target.decode_address)
            raise
        finally:
            sender.abort()  # no-op once DONE
            self._outgoing.pop(request_id, None)
        return PrefillResult(
            first_token_id=first_token_id,
            first_logprob=last.logprobs[0] if last.logprobs else None,
            num_cached_tokens=last.update.num_cached_tokens,
            prefill_ms=(computed - started) * 1000,
            transfer_wait_ms=(time.perf_counter() - computed) * 1000,
            bytes_sent=bytes_sent,
        )

    def _check_target(self, prompt_token_ids: Sequence[int], target: KvTarget) -> None:
        if target.compat_hash != self.layout.compat_hash:
            raise IncompatibleKvLayoutError(
                "the decode worker's KV layout hash differs from this prefill worker's "
                f"({target.compat_hash} != {self.layout.compat_hash})"
            )
        expected = blocks_for_tokens(len(prompt_token_ids), self.layout.block_size)
        if (
            target.num_tokens != len(prompt_token_ids)
            or target.num_blocks != expected
            or target.plan.num_blocks != expected
        ):
            raise InvalidRequestError(
                f"reservation covers {target.num_tokens} tokens / {target.num_blocks} blocks, "
                f"its plan {target.plan.num_blocks} blocks, prompt has "
                f"{len(prompt_token_ids)} tokens / {expected} blocks",
                "target",
            )

    def _push_layer(self, layer: int, scheduled: SchedulerOutput) -> None:
        """Engine thread: hand each finishing prompt's KV of ``layer`` to its sender."""
        for chunk in scheduled.chunks:
            if not chunk.samples:
                continue  # an earlier chunk: the layer's KV is not complete yet
            outgoing = self._outgoing.get(chunk.request_id)
            if outgoing is None or layer in outgoing.gathered:
                continue
            outgoing.gathered.add(layer)
            plan = outgoing.sender.plan
            block_ids = chunk.block_table[: plan.num_blocks]
            kv = gather_layer(self.core, layer, block_ids, plan, outgoing.staging[layer])
            outgoing.sender.offer(layer, kv)

    async def _peer(self, address: str) -> _Peer:
        """The handshaken link to a decode worker (created once per address)."""
        lock = self._peer_locks.setdefault(address, asyncio.Lock())
        async with lock:
            peer = self._peers.get(address)
            if peer is not None:
                return peer
            channel = insecure_channel(address)
            self._channels.append(channel)
            stub = worker_pb2_grpc.DecodeWorkerStub(channel)
            try:
                reply = await stub.KvHandshake(
                    worker_pb2.KvHandshakeRequest(
                        layout=convert.layout_to_proto(self.layout),
                        prefill_worker_id=self.identity.worker_id,
                    ),
                    timeout=self.transfer_timeout_s,
                )
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    raise IncompatibleKvLayoutError(error.details() or "") from None
                raise TransferError(f"KV handshake with {address} failed: {error.code()}") from None
            if reply.transport != self.transport.name:
                raise IncompatibleKvLayoutError(
                    f"decode worker {address} transfers KV over {reply.transport!r}, "
                    f"this prefill worker over {self.transport.name!r}"
                )
            endpoint = await self.transport.connect(reply.ucx_address)
            peer = _Peer(stub, endpoint, reply.ucx_address)
            self._peers[address] = peer
            return peer

    def _forget_peer(self, address: str) -> None:
        """After a failed transfer: handshake and reconnect on next use (it may have restarted)."""
        peer = self._peers.pop(address, None)
        if peer is not None:
            self.transport.forget(peer.transfer_address)

    async def load(self) -> EngineLoad:
        """The engine's latest load figures (answers at once, also during a long step)."""
        return self.engine.latest_load

    async def close(self) -> None:
        self.engine.shutdown()
        for channel in self._channels:
            await channel.close()
