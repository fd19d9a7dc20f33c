"""Typed clients of the worker services: the only code that calls the worker stubs.

Callers (the coordinator's attempts, the prefill worker's KV push) pass and receive domain
objects; proto messages are built and read here through ``convert``, and every failed call
raises the domain error ``status.error_from_rpc`` maps it to (``InvalidRequestError``,
``CapacityError``, ``IncompatibleKvLayoutError``, ``WorkerUnavailableError`` when the worker
is unreachable, else ``WorkerCallError``). Every call carries a deadline and the cluster
credential (``cluster_auth``). ``WorkerChannels`` keeps one channel per worker address,
created on first use and closed by ``close``.

The coordinator relays a decode worker's KV reservation to the prefill worker unread
(``RelayedReservation``): only the prefill worker, which pushes the KV by its plan, parses and
checks it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence, Set
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from splitserve.common.adapter_id import AdapterId
from splitserve.common.errors import ModelLoadError, ModelNotFoundError
from splitserve.common.kv_layout import KvLayout
from splitserve.common.load import LoadReport
from splitserve.common.request_update import StepOutput
from splitserve.common.sampling_params import SamplingParams
from splitserve.proto import convert
from splitserve.proto.cluster_access import ClusterAccess
from splitserve.proto.cluster_auth import ClusterCredential
from splitserve.proto.splitserve.v1 import worker_pb2, worker_pb2_grpc
from splitserve.proto.status import call_internal, error_from_rpc
from splitserve.proto.streams_client import StreamError, StreamsClientCall
from splitserve.transfer.reservation import (
    CachedKvPull,
    FirstToken,
    KvHandshake,
    KvReservation,
    PrefillDone,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class RelayedReservation:
    """A decode worker's KV reservation on its way to the prefill worker, as the decode
    stream carried it: the coordinator passes it on to ``PrefillWorkerClient.prefill`` and
    never reads it. The prefill worker is the one that parses and checks it
    (``convert.reservation_from_proto``: a plan that does not describe the reserved blocks,
    or a transfer secret of the wrong size, is refused with INVALID_ARGUMENT there, so the
    prefill fails and the request is prefilled on its decode worker)."""

    message: worker_pb2.KvReservation = field(repr=False)
    """The wire message, never modified; it holds the transfer secret, so it stays out of
    ``repr`` (and logs)."""


class DecodeCall:
    """One ``DecodeWorker.Generate`` call: iterate for the reservation (remote prefill only,
    first) and the request's step outputs, every generated token once; ``cancel`` ends the
    call, which aborts the request on the decode worker and frees its blocks."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, request_id: str) -> None:
        self._call = call
        self._request_id = request_id

    async def __aiter__(self) -> AsyncIterator[RelayedReservation | StepOutput]:
        try:
            async for message in self._call:
                yield _decode_item(self._request_id, message)
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc(error) from None

    def cancel(self) -> None:
        self._call.cancel()


class MultiplexedDecodeCall:
    """A ``DecodeCall`` whose stream travels on the decode worker's shared
    ``GenerateStreams`` call (``streams_client.py``): the same items and the same domain
    errors (a broken shared call fails every stream on it as a broken ``Generate`` call
    would); ``cancel`` sends the stream's cancel, which aborts the request there; the
    stream's deadline (``timeout_s``) is kept here, as a ``WorkerCallError``.

    ``listen``: a step output may instead be taken as it arrives, inside the shared call's
    reader (no task switch per stream and step): the listener is offered each one while
    nothing waits before it here, and returns True when it took it; what it declines is
    iterated as usual, in order."""

    def __init__(
        self,
        streams: StreamsClientCall,
        request: worker_pb2.WorkerGenerateRequest,
        timeout_s: float,
    ) -> None:
        self._streams = streams
        self._request_id = request.request_id
        self._items: collections.deque[RelayedReservation | StepOutput] = collections.deque()
        self._arrived = asyncio.Event()
        self._outcome: StreamError | None = None
        """How the stream ended (code OK: completed); None while it runs."""
        self._listener: Callable[[StepOutput], bool] | None = None
        self._key = streams.open(self, request)
        self._expiry = asyncio.get_running_loop().call_later(timeout_s, self._expire)
        """One timer for the deadline (not one per wait: the relay's hot path)."""

    def listen(self, listener: Callable[[StepOutput], bool] | None) -> None:
        """Offer each step output to ``listener`` first (see the class; None: stop)."""
        self._listener = listener

    def deliver(self, item: worker_pb2.WorkerStreamItem) -> None:
        if item.HasField("response"):
            try:
                decoded = _decode_item(self._request_id, item.response)
            except Exception as error:  # a malformed message: this stream is lost, not the call
                logger.exception("%s: a malformed decode stream message", self._request_id)
                self.cancel()
                self._outcome = StreamError(grpc.StatusCode.INTERNAL, repr(error))
                self._arrived.set()
                return
            listener = self._listener
            if (
                listener is not None
                and not self._items
                and isinstance(decoded, StepOutput)
                and listener(decoded)
            ):
                return
            self._items.append(decoded)
        else:
            self._end(StreamError.of_end(item.end))
            self._streams.ended(self._key)
        self._arrived.set()

    def fail(self, error: StreamError) -> None:
        if self._outcome is None:
            self._end(error)
            self._arrived.set()

    def _expire(self) -> None:
        if self._outcome is None:
            self.cancel()
            self._outcome = StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            self._arrived.set()

    def _end(self, outcome: StreamError) -> None:
        self._outcome = outcome
        self._expiry.cancel()

    async def __aiter__(self) -> AsyncIterator[RelayedReservation | StepOutput]:
        while True:
            while self._items:
                yield self._items.popleft()
            outcome = self._outcome
            if outcome is not None:
                if outcome.code() == grpc.StatusCode.OK:
                    return
                raise error_from_rpc(outcome)  # type: ignore[arg-type]
            self._arrived.clear()
            await self._arrived.wait()

    def cancel(self) -> None:
        if self._outcome is None:
            self._end(StreamError(grpc.StatusCode.CANCELLED, "Cancelled"))
            self._streams.cancel(self._key)


def _decode_item(
    request_id: str, message: worker_pb2.WorkerGenerateResponse
) -> RelayedReservation | StepOutput:
    if message.HasField("reservation"):
        return RelayedReservation(message.reservation)
    return convert.step_output_from_proto(request_id, message.tokens)


class DecodeWorkerClient:
    def __init__(
        self,
        channel: grpc.aio.Channel,
        credential: ClusterCredential,
        streams: StreamsClientCall | None = None,
    ) -> None:
        """``streams``: the worker's shared ``GenerateStreams`` call, which ``generate``
        then starts its streams on (None: a ``Generate`` call each)."""
        self._stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        self._metadata = credential.metadata
        self.streams = streams

    def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        remote_prefill: bool,
        timeout_s: float,
        prior_output_token_ids: Sequence[int] = (),
        traceparent: str = "",
    ) -> DecodeCall | MultiplexedDecodeCall:
        """Start the request on the decode worker (stop strings stay with the caller);
        ``prior_output_token_ids``: a resumed request's earlier tokens; ``traceparent``: the
        caller's span (``common/tracing.py``)."""
        request = worker_pb2.WorkerGenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling=convert.sampling_to_proto(params, include_stop=False),
            remote_prefill=remote_prefill,
            prior_output_token_ids=prior_output_token_ids,
            traceparent=traceparent,
        )
        if self.streams is not None:
            return MultiplexedDecodeCall(self.streams, request, timeout_s)
        return DecodeCall(
            self._stub.Generate(request, timeout=timeout_s, metadata=self._metadata), request_id
        )

    async def stop(self, request_id: str, as_stopped: bool, timeout_s: float) -> bool:
        """End a request there (STOP when ``as_stopped``, else ABORT); False if unknown."""
        request = worker_pb2.WorkerAbortRequest(request_id=request_id, as_stopped=as_stopped)
        reply = await call_internal(
            self._stub.Abort(request, timeout=timeout_s, metadata=self._metadata)
        )
        return reply.aborted

    async def handshake(self, layout: KvLayout, timeout_s: float) -> KvHandshake:
        """Compare KV layouts (``IncompatibleKvLayoutError`` on mismatch); the peer's
        transport address."""
        request = worker_pb2.KvHandshakeRequest(layout=convert.layout_to_proto(layout))
        reply = await call_internal(
            self._stub.KvHandshake(request, timeout=timeout_s, metadata=self._metadata)
        )
        return convert.handshake_from_proto(reply)

    async def complete_kv(
        self, reservation: KvReservation, request_id: str, first: FirstToken, timeout_s: float
    ) -> None:
        """Every layer was sent: returns once the KV landed and the request decodes."""
        request = convert.first_token_to_proto(reservation, request_id, first)
        await call_internal(
            self._stub.CompleteKv(request, timeout=timeout_s, metadata=self._metadata)
        )

    async def push_cached_kv(self, pull: CachedKvPull, timeout_s: float) -> int:
        """Have the decode worker push KV it holds for an open reservation into the caller's
        blocks (the reverse transfer); returns the bytes it sent, once it sent them all."""
        reply = await call_internal(
            self._stub.PushCachedKv(
                convert.pull_to_proto(pull), timeout=timeout_s, metadata=self._metadata
            )
        )
        return reply.bytes_sent


class PrefillWorkerClient:
    def __init__(self, channel: grpc.aio.Channel, credential: ClusterCredential) -> None:
        self._stub = worker_pb2_grpc.PrefillWorkerStub(channel)
        self._metadata = credential.metadata

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        reservation: RelayedReservation,
        timeout_s: float,
        traceparent: str = "",
    ) -> PrefillDone:
        """Compute the prompt and push its KV into ``reservation``; cancelling aborts it.
        ``traceparent``: the caller's span (``common/tracing.py``)."""
        request = worker_pb2.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling=convert.sampling_to_proto(params, include_stop=False),
            target=reservation.message,
            traceparent=traceparent,
        )
        reply = await call_internal(
            self._stub.Prefill(request, timeout=timeout_s, metadata=self._metadata)
        )
        return convert.prefill_done_from_proto(reply)


class WorkerMonitorClient:
    def __init__(self, channel: grpc.aio.Channel, credential: ClusterCredential) -> None:
        self._stub = worker_pb2_grpc.WorkerMonitorStub(channel)
        self._metadata = credential.metadata

    async def watch_load(self, interval_s: float) -> AsyncIterator[LoadReport]:
        """The worker's load report now and every ``interval_s`` after, until the caller stops;
        raises the domain error of a broken stream (``WorkerUnavailableError`` when the
        worker is gone)."""
        request = worker_pb2.WatchLoadRequest(interval_ms=round(interval_s * 1000))
        call = self._stub.WatchLoad(request, metadata=self._metadata)
        try:
            async for load in call:
                yield convert.report_from_proto(load)
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc(error) from None
        finally:
            call.cancel()


class WorkerAdaptersClient:
    """A worker's ``WorkerAdapters`` calls (``worker/adapters_servicer.py``), each with a
    deadline; errors as domain errors: NOT_FOUND ``ModelNotFoundError``,
    FAILED_PRECONDITION ``ModelLoadError`` (runtime changes off there), INVALID_ARGUMENT
    ``InvalidRequestError`` with the worker's ``param``; others as ``error_from_rpc``."""

    def __init__(self, channel: grpc.aio.Channel, credential: ClusterCredential) -> None:
        self._stub = worker_pb2_grpc.WorkerAdaptersStub(channel)
        self._metadata = credential.metadata

    async def load(
        self,
        name: str,
        path: str,
        timeout_s: float,
        *,
        replace: bool = False,
        check_only: bool = False,
    ) -> tuple[AdapterId, bool]:
        """Serve the adapter in ``path`` as ``name`` there (``replace``: in place of other
        files under that name; ``check_only``: only read and check it, as the first phase
        of an in-place load): its id, and whether it is (or would be) newly served (False:
        the same files were served under that name already)."""
        request = worker_pb2.LoadAdapterRequest(
            name=name, path=path, replace=replace, check_only=check_only
        )
        reply = await _adapter_call(
            self._stub.LoadAdapter(request, timeout=timeout_s, metadata=self._metadata)
        )
        return convert.adapters_from_proto([reply.adapter])[0], reply.newly_loaded

    async def unload(self, name: str, timeout_s: float) -> None:
        request = worker_pb2.UnloadAdapterRequest(name=name)
        await _adapter_call(
            self._stub.UnloadAdapter(request, timeout=timeout_s, metadata=self._metadata)
        )


async def _adapter_call(call: Awaitable[T]) -> T:
    try:
        return await call
    except grpc.aio.AioRpcError as error:
        code, details = error.code(), error.details() or ""
        if code is grpc.StatusCode.NOT_FOUND:
            raise ModelNotFoundError(details) from None
        if code is grpc.StatusCode.FAILED_PRECONDITION:
            raise ModelLoadError(details) from None
        raise error_from_rpc(error) from None


class WorkerChannels:
    """One channel per worker address, created on first use (TLS when ``access`` has it);
    calls carry the cluster credential. With ``multiplexed``, decode streams to an address
    travel on one ``GenerateStreams`` call there, opened on first use and again after it
    broke."""

    def __init__(self, access: ClusterAccess, multiplexed: bool = False) -> None:
        self._access = access
        self._multiplexed = multiplexed
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._decode_streams: dict[str, StreamsClientCall] = {}
        self._decode_clients: dict[str, DecodeWorkerClient] = {}
        self._prefill_clients: dict[str, PrefillWorkerClient] = {}
        self._unlisted_since: dict[str, float] = {}

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self._access.channel(address)
        return channel

    @property
    def addresses(self) -> frozenset[str]:
        return frozenset(self._channels)

    async def retain(self, addresses: Set[str], grace_s: float, now: float) -> None:
        """Close the channels to addresses not in ``addresses`` for ``grace_s`` running
        (a worker that left may still be finishing streams over its channel; one that comes
        back gets a fresh channel on next use)."""
        for address in list(self._channels):
            if address in addresses:
                self._unlisted_since.pop(address, None)
                continue
            since = self._unlisted_since.setdefault(address, now)
            if now - since >= grace_s:
                del self._unlisted_since[address]
                if (streams := self._decode_streams.pop(address, None)) is not None:
                    streams.close()
                self._decode_clients.pop(address, None)
                self._prefill_clients.pop(address, None)
                await self._channels.pop(address).close()

    def decode(self, address: str) -> DecodeWorkerClient:
        """The decode worker's client: kept while its channel and (multiplexed) its streams
        call are (a client is only its stub, credential and call: making one a request cost
        more than relaying one of its tokens)."""
        kept = self._decode_clients.get(address)
        if kept is not None and (kept.streams is None or kept.streams.accepting):
            return kept
        channel = self._channel(address)
        credential = self._access.credential
        streams = None
        if self._multiplexed:
            stub = worker_pb2_grpc.DecodeWorkerStub(channel)
            streams = self._decode_streams[address] = StreamsClientCall(
                lambda requests: stub.GenerateStreams(requests, metadata=credential.metadata),
                worker_pb2.WorkerStreamsRequest,
                worker_pb2.WorkerStreamStart,
            )
        self._decode_clients[address] = DecodeWorkerClient(channel, credential, streams)
        return self._decode_clients[address]

    def prefill(self, address: str) -> PrefillWorkerClient:
        """The prefill worker's client, kept while its channel is."""
        client = self._prefill_clients.get(address)
        if client is None:
            client = PrefillWorkerClient(self._channel(address), self._access.credential)
            self._prefill_clients[address] = client
        return client

    def monitor(self, address: str) -> WorkerMonitorClient:
        return WorkerMonitorClient(self._channel(address), self._access.credential)

    def adapters(self, address: str) -> WorkerAdaptersClient:
        return WorkerAdaptersClient(self._channel(address), self._access.credential)

    async def close(self) -> None:
        for streams in self._decode_streams.values():
            streams.close()
        self._decode_streams.clear()
        self._decode_clients.clear()
        self._prefill_clients.clear()
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._unlisted_since.clear()
