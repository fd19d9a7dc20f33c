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

Each completed push teaches the worker its links (``common/kv_push_cost.py:KvPushLearner``):
the exposed transfer, from the prompt's compute end (this worker's event loop has its first
token) to the last layer's sends completing, against the tokens whose KV travelled, per
decode worker address and over all pushes. A link's fit lives as long as the link (dropped
with an idle peer, kept across a failed transfer's re-handshake); ``kv_push_costs`` is what
the worker's load reports, for placement's remote TTFT.

The engine's own blocks go back to its pool (and prefix cache) when the request finishes:
only the staging buffer waits for the decode worker's confirmation.

Pulling cached KV (the reverse transfer): when the decode worker's reservation says it holds
more of the prompt's leading blocks (``KvReservation.num_cached_blocks``, e.g. a
conversation's last reply, decoded there) than this worker's prefix cache does
(``AsyncEngine.cached_prefix_blocks``), by at least ``TransferSettings.pull_min_blocks``,
``prefill`` first posts a ``LayerReceiver`` for the difference into a staging buffer, under
a secret of its own, and asks the decode worker to send them (``PushCachedKv``, a
``CachedKvPull``). Once every message landed with its planned size, the prompt is submitted
with them (``PulledKv``): in the same engine command they enter the prefix cache after the
blocks it holds (``EngineCore.adopt_pulled_kv``), so the engine computes only the tokens
after them, and the pull costs no extra wait for the engine's step. A pull that fails or
times out costs only time: nothing of it reaches the engine (its staging buffer is kept until
its receives settled), and the prompt is computed as without it (never a wrong token).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from opentelemetry.trace import Span, StatusCode

from splitserve.common.blocks import BlockHash, blocks_for_tokens, prefix_root
from splitserve.common.errors import (
    IncompatibleKvLayoutError,
    InvalidRequestError,
    TransferAbortedError,
    TransferError,
    WorkerCallError,
    WorkerUnavailableError,
)
from splitserve.common.kv_layout import KvLayout
from splitserve.common.kv_push_cost import KvPushCosts, KvPushLearner
from splitserve.common.request_update import StepOutput
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.tracing import NO_SPAN, start_span
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.engine_face import CompletedPrompt, PulledKv
from splitserve.proto.worker_clients import DecodeWorkerClient, WorkerChannels
from splitserve.transfer.destination import KvDestination, min_message_bytes
from splitserve.transfer.layer_channel import LayerReceiver, LayerSender
from splitserve.transfer.plan import new_transfer_secret
from splitserve.transfer.reservation import CachedKvPull, FirstToken, KvReservation, PrefillDone
from splitserve.transfer.transport import KvEndpoint, KvTransport
from splitserve.worker.identity import WorkerIdentity
from splitserve.worker.kv_io import gather_layer, kv_layout_of, staging_buffer
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
        self.kv_message_bytes = transfer.min_message_bytes  # None: by the cache's device
        self.pulls_cached_kv_min_blocks = transfer.pull_min_blocks
        self._outgoing: dict[str, _Outgoing] = {}
        self._peers: dict[str, _Peer] = {}
        if identity.access is None:
            raise ValueError("a prefill worker calls decode workers: it needs cluster access")
        self._channels = WorkerChannels(identity.access)
        self._peer_locks: dict[str, asyncio.Lock] = {}
        self._settling: set[asyncio.Task[None]] = set()  # failed pulls' receives settling
        self.transfer_metrics = TransferMetrics()
        self._push_costs = KvPushLearner()

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
        pulled = None
        if params.prompt_logprobs is None:  # else the whole prompt is computed: nothing to take
            root = prefix_root(params.cache_salt, self.engine.adapter_digest(params.adapter))
            pulled = await self._pull_cached_kv(
                request_id, prompt_token_ids, root, target, peer, span
            )
        engine_id = request_id + self._engine_id_suffix
        sender = self._expect_push(engine_id, target, peer)
        compute = start_span("prefill compute", request_id, parent=span)
        push = NO_SPAN
        try:
            last = await self._compute(
                request_id, engine_id, prompt_token_ids, params, pulled, compute
            )
            push = start_span("kv push", request_id, parent=span)
            await self._finish_push(push, sender, target)
            num_cached_tokens = last.update.num_cached_tokens
            first = FirstToken(
                last.update.new_token_ids[0],
                last.logprobs[0] if last.logprobs else None,
                num_cached_tokens,
                last.prompt_logprobs,
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

    def _expect_push(self, engine_id: str, target: KvReservation, peer: _Peer) -> LayerSender:
        """Register the request's outgoing KV under its engine id: a sender to the decode
        worker's reservation, and the staging buffer the layer hook gathers each layer into
        (``_push_layer``). The caller unregisters it and aborts the sender."""
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
        return sender

    async def _compute(
        self,
        request_id: str,
        engine_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        pulled: PulledKv | None,
        compute: Span,
    ) -> StepOutput:
        """Run the prompt on the engine (as ``engine_id``) for its first token only, with the
        ``pulled`` KV if any, and end its ``compute`` span; the last output, which has the token.
        ``TransferAbortedError`` when the request was aborted before it."""
        first_only = dataclasses.replace(
            params, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=()
        )
        last = None
        prompt = list(prompt_token_ids)
        async for output in self.engine.generate(engine_id, prompt, first_only, pulled):
            last = output
        compute.set_attribute("splitserve.prompt_tokens", len(prompt_token_ids))
        compute.end()
        if last is None or not last.update.new_token_ids:
            raise TransferAbortedError(f"request {request_id!r} was aborted during prefill")
        return last

    async def _finish_push(self, push: Span, sender: LayerSender, target: KvReservation) -> None:
        """Wait until every layer was sent (``_finish_sends``), the push described on its
        span: blocks sent and already cached there, layers, bytes, exposed seconds."""
        push.set_attribute("splitserve.kv_blocks", target.num_blocks)
        push.set_attribute("splitserve.kv_cached_blocks", target.num_cached_blocks)
        push.set_attribute("splitserve.kv_layers", self.layout.num_layers)
        bytes_sent, exposed_s = await self._finish_sends(sender)
        push.set_attribute("splitserve.kv_bytes", bytes_sent)
        push.set_attribute("splitserve.kv_exposed_s", exposed_s)
        pushed_tokens = target.num_tokens - target.num_cached_blocks * self.layout.block_size
        self._push_costs.observe(target.decode_address, pushed_tokens, exposed_s)

    def kv_push_costs(self) -> KvPushCosts:
        """What this worker learned of its pushes' exposed transfer (the module docstring),
        for its load reports."""
        return self._push_costs.estimate()

    async def _pull_cached_kv(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        root: BlockHash | None,
        target: KvReservation,
        peer: _Peer,
        span: Span,
    ) -> PulledKv | None:
        """Receive the decode worker's cached blocks of the prompt that this engine's prefix
        cache lacks (module docstring), for the prompt's request to take in. None when
        nothing is pulled: too little to gain, or the pull failed (the prompt is then
        computed as without it). ``root``: where the prompt's block hashes start (its salt
        and adapter)."""
        wanted = target.num_cached_blocks
        held = min(self.engine.cached_prefix_blocks(prompt_token_ids, root), wanted)
        if not self.pulls_cached_kv_min_blocks or wanted - held < self.pulls_cached_kv_min_blocks:
            return None
        staging = staging_buffer(self.engine.paged_kv, wanted - held)
        receiver, pull = self._post_pull(request_id, target, held, staging)
        num_bytes = staging.numel() * staging.element_size()
        pulling = start_span("kv pull", request_id, parent=span)
        pulling.set_attribute("splitserve.kv_blocks", pull.plan.num_blocks)
        pulling.set_attribute("splitserve.kv_bytes", num_bytes)
        started = time.monotonic()
        try:
            await peer.client.push_cached_kv(pull, self.transfer_timeout_s)
            await receiver.wait(self.transfer_timeout_s)
        except (
            TransferError,
            WorkerUnavailableError,
            WorkerCallError,
            InvalidRequestError,
        ) as error:
            self.transfer_metrics.failed("receive", error)
            pulling.set_status(StatusCode.ERROR, type(error).__name__)
            logger.warning(
                "request %r: pulling cached KV failed (%s); computing it", request_id, error
            )
            self._keep_until_settled(receiver, staging)
            return None
        except BaseException:
            self._keep_until_settled(receiver, staging)
            raise
        finally:
            pulling.end()
        self.transfer_metrics.completed("receive", num_bytes, time.monotonic() - started)
        self.transfer_metrics.pulled_blocks.inc(pull.plan.num_blocks)
        return PulledKv(held, staging)

    def _post_pull(
        self, request_id: str, target: KvReservation, held: int, staging: torch.Tensor
    ) -> tuple[LayerReceiver, CachedKvPull]:
        """A receiver posted for the reservation's cached blocks after the ``held`` ones into
        ``staging``, under a secret of its own, and the ask for the decode worker to send
        them there (``PushCachedKv``)."""
        group_bytes = min_message_bytes(staging.device, self.kv_message_bytes)
        blocks = range(target.num_cached_blocks - held)  # every block of staging: straight
        destination = KvDestination(staging, blocks, group_bytes)
        plan = destination.plan
        secret = new_transfer_secret()
        receiver = LayerReceiver(self.transport, secrets.randbits(64), secret, destination)
        pull = CachedKvPull(
            target.transfer_id,
            request_id,
            held,
            self.transport.address,
            plan,
            secret,
            self.layout.compat_hash,
        )
        return receiver, pull

    def _keep_until_settled(self, receiver: LayerReceiver, staging: torch.Tensor) -> None:
        """A pull that did not land: stop its receiver, and keep its staging buffer alive
        until no message can land there any more (for good, if a receive never settles)."""
        if receiver.settled:
            return
        task = asyncio.get_running_loop().create_task(self._settle(receiver, staging))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    @staticmethod
    async def _settle(receiver: LayerReceiver, staging: torch.Tensor) -> None:
        """Hold ``staging`` (an argument: referenced until this returns) while ``receiver``
        stops and settles."""
        await receiver.abort()
        await receiver.until_settled()

    async def _finish_sends(self, sender: LayerSender) -> tuple[int, float]:
        """Wait until every layer was sent (called once the prompt is computed); record the
        transfer; the bytes sent and the seconds the wait took (the exposed transfer)."""
        computed = time.perf_counter()
        try:
            bytes_sent = await sender.finish(self.transfer_timeout_s)
        except BaseException as error:
            self.transfer_metrics.failed("send", error)
            raise
        exposed_s = time.perf_counter() - computed
        self.transfer_metrics.completed("send", bytes_sent, exposed_s)
        return bytes_sent, exposed_s

    def _check_target(self, prompt_token_ids: Sequence[int], target: KvReservation) -> None:
        if target.compat_hash != self.layout.compat_hash:
            raise IncompatibleKvLayoutError(
                "the decode worker's KV layout hash differs from this prefill worker's "
                f"({target.compat_hash} != {self.layout.compat_hash})"
            )
        target.plan.check_groups(self.layout.num_layers, "target")
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
            self._push_costs.forget(address)
        if idle:
            await self._channels.retain(set(self._peers), grace_s=60.0, now=now)

    async def close(self) -> None:
        """Close the links to decode workers; the engine is its creator's to shut down."""
        for task in self._settling:
            task.cancel()
        await self._channels.close()
