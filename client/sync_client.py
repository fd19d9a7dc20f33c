"""``Client``: the coordinator's public API for blocking callers (scripts, notebooks).

The same methods and contracts as ``AsyncClient``, over a sync gRPC channel:

- Deadline: each call gets ``timeout_s`` (the method's, else the client's; None = none),
  covering all attempts; running out raises ``ClientError`` DEADLINE_EXCEEDED.
- Errors: every failure is a ``ClientError`` with ``code``, ``message``, ``param`` and
  ``retry_after_s``.
- Retries: done by gRPC on the client's channel (``splitserve.client.retry``): UNAVAILABLE,
  and RESOURCE_EXHAUSTED when ``retry.retry_overloaded`` (the server's hint honoured), never
  once a stream delivered a ``Chunk``, at most ``retry.max_attempts`` attempts, with the same
  request (and ``request_id``, uuid4 hex when not given).
- Coordinator failure: a stream continues through another coordinator after its own died,
  as in ``AsyncClient`` (``continuation.StreamContinuation``, shared by both).
- Cancellation: ``stream()`` returns a generator; when the caller stops early (the generator
  is closed or garbage collected) the gRPC call is cancelled and the coordinator aborts the
  request on every worker. ``with contextlib.closing(client.stream(...)) as items`` makes that
  immediate after a ``break``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from types import EllipsisType, TracebackType
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.client import wire
from splitserve.client.connection import call_metadata, sync_channel
from splitserve.client.continuation import StreamContinuation
from splitserve.client.errors import DEFAULT_RETRY, ClientError, RetryPolicy
from splitserve.client.retry import Deadline, resolve_timeout
from splitserve.client.tools import tool_request, with_tool_calls
from splitserve.client.types import (
    ChatTemplate,
    Chunk,
    Finish,
    Generation,
    LatencyTargets,
    LoadedAdapter,
    ModelInfo,
    Sampling,
)
from splitserve.proto.splitserve.v1 import coordinator_pb2, coordinator_pb2_grpc

Reply = TypeVar("Reply")
HEALTH_POLL_S = 0.1


class Client:
    """Typed blocking client of a splitserve coordinator at ``target`` ("host:port").

    ``retry`` is fixed when the channel is created, here; ``api_key`` and ``credentials``
    (TLS): see ``splitserve.client.connection``. ``channel``: use this one instead of
    creating one (the caller owns it; ``close()`` leaves it open); it retries as
    it was built, by ``retry`` only when built with ``retry.channel_options(retry)``.
    """

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        timeout_s: float | None = 600.0,
        retry: RetryPolicy = DEFAULT_RETRY,
        channel: grpc.Channel | None = None,
        api_key: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.target = target
        self._metadata = call_metadata(api_key)
        self._formats: tuple[str, str] | None = None
        self.timeout_s = timeout_s
        self.retry = retry
        self._owns_channel = channel is None
        self._channel = channel or sync_channel(target, credentials, retry)
        self._coordinator = coordinator_pb2_grpc.CoordinatorStub(self._channel)

    def stream(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[wire.MessageLike] | None = None,
        token_ids: Sequence[int] | None = None,
        sampling: Sampling | None = None,
        request_id: str | None = None,
        priority: int = 0,
        targets: LatencyTargets | None = None,
        timeout_s: float | None | EllipsisType = ...,
        traceparent: str = "",
        session_id: str = "",
        model: str = "",
        add_special_tokens: bool | None = None,
        chat_template: ChatTemplate | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> Generator[Chunk | Finish, None, None]:
        """Stream a completion of exactly one of ``prompt``, ``messages`` or ``token_ids``:
        ``Chunk``s, then exactly one ``Finish``; raises ``ClientError``.

        A generator: nothing happens until iteration starts, where wrong arguments raise
        ``ValueError`` / ``TypeError`` or ``ClientError`` INVALID_ARGUMENT (see ``AsyncClient``).
        """
        request = wire.generate_request(
            prompt, messages, token_ids, sampling, request_id, priority, targets, traceparent,
            session_id, model, add_special_tokens, chat_template, truncate_prompt_tokens,
        )  # fmt: skip
        stream = StreamContinuation(request, Deadline(self._timeout(timeout_s)), self._start)
        while stream.needs_call:
            with stream.next_call() as call:
                for response in call:
                    if (chunk := stream.receive(response)) is not None:
                        yield chunk
        yield stream.finish()

    def _start(
        self, request: coordinator_pb2.GenerateRequest, timeout_s: float | None
    ) -> grpc.Call:
        """One ``Generate`` call of a stream (``StreamContinuation``'s ``start``)."""
        return self._coordinator.Generate(request, timeout=timeout_s, metadata=self._metadata)

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[wire.MessageLike] | None = None,
        token_ids: Sequence[int] | None = None,
        sampling: Sampling | None = None,
        request_id: str | None = None,
        priority: int = 0,
        targets: LatencyTargets | None = None,
        timeout_s: float | None | EllipsisType = ...,
        traceparent: str = "",
        session_id: str = "",
        model: str = "",
        add_special_tokens: bool | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        chat_template: ChatTemplate | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> Generation:
        """The whole completion of ``stream()`` with the same arguments, joined; ``tools``
        as ``AsyncClient.generate``."""
        tool_format, reasoning_format = self._served_formats()
        asked = tool_request(
            messages, sampling, tools, tool_choice, parallel_tool_calls, tool_format,
            chat_template, reasoning_format,
        )  # fmt: skip
        chunks: list[Chunk] = []
        items = self.stream(
            prompt,
            messages=asked.messages,
            token_ids=token_ids,
            sampling=asked.sampling,
            request_id=request_id,
            priority=priority,
            traceparent=traceparent,
            session_id=session_id,
            model=model,
            targets=targets,
            timeout_s=timeout_s,
            add_special_tokens=add_special_tokens,
            chat_template=asked.chat_template,
            truncate_prompt_tokens=truncate_prompt_tokens,
        )
        with contextlib.closing(items):
            for item in items:
                if isinstance(item, Finish):
                    return with_tool_calls(
                        Generation.of(chunks, item), asked.plan, reasoning_format
                    )
                chunks.append(item)
        raise AssertionError("unreachable: stream() ends with a Finish or raises")

    def abort(self, request_id: str, *, timeout_s: float | None | EllipsisType = ...) -> bool:
        """Abort a running request by id (idempotent): its stream ends with finish_reason
        "abort". False when no such request is running."""
        request = coordinator_pb2.AbortRequest(request_id=request_id)
        return self._unary(self._coordinator.Abort, request, timeout_s).aborted

    def _served_formats(self) -> tuple[str, str]:
        """The served model's tool-call and reasoning formats (``ModelInfo``), asked once:
        they hold for the coordinator's life."""
        if self._formats is None:
            info = self.model_info()
            self._formats = (info.tool_call_format, info.reasoning_format)
        return self._formats

    def model_info(self, *, timeout_s: float | None | EllipsisType = ...) -> ModelInfo:
        """The served model: name, context window, vocabulary, EOS ids, dtype."""
        request = coordinator_pb2.GetModelInfoRequest()
        return wire.model_info(self._unary(self._coordinator.GetModelInfo, request, timeout_s))

    def load_lora_adapter(
        self,
        name: str,
        path: str,
        *,
        load_inplace: bool = False,
        timeout_s: float | None | EllipsisType = ...,
    ) -> LoadedAdapter:
        """Serve the LoRA adapter in ``path`` as ``name`` (``AsyncClient.load_lora_adapter``)."""
        request = coordinator_pb2.LoadLoraAdapterRequest(
            lora_name=name, lora_path=path, load_inplace=load_inplace
        )
        reply = self._unary(self._coordinator.LoadLoraAdapter, request, timeout_s)
        return LoadedAdapter(reply.adapter.name, reply.adapter.digest, reply.workers)

    def unload_lora_adapter(
        self, name: str, *, timeout_s: float | None | EllipsisType = ...
    ) -> int:
        """Stop serving ``name`` (``AsyncClient.unload_lora_adapter``)."""
        request = coordinator_pb2.UnloadLoraAdapterRequest(lora_name=name)
        return self._unary(self._coordinator.UnloadLoraAdapter, request, timeout_s).workers

    def tokenize(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[wire.MessageLike] | None = None,
        add_special_tokens: bool | None = None,
        timeout_s: float | None | EllipsisType = ...,
        chat_template: ChatTemplate | None = None,
    ) -> list[int]:
        """The token ids ``stream`` would send the model (see ``AsyncClient.tokenize``)."""
        request = wire.tokenize_request(prompt, messages, add_special_tokens, chat_template)
        return list(self._unary(self._coordinator.Tokenize, request, timeout_s).token_ids)

    def detokenize(
        self,
        token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = False,
        timeout_s: float | None | EllipsisType = ...,
    ) -> str:
        """The text of ``token_ids``; ids outside the vocabulary are INVALID_ARGUMENT."""
        request = coordinator_pb2.DetokenizeRequest(
            token_ids=list(token_ids), skip_special_tokens=skip_special_tokens
        )
        return self._unary(self._coordinator.Detokenize, request, timeout_s).text

    def _unary(
        self,
        method: Callable[..., Reply],
        request: object,
        timeout_s: float | None | EllipsisType,
    ) -> Reply:
        try:
            return method(request, timeout=self._timeout(timeout_s), metadata=self._metadata)
        except grpc.RpcError as rpc_error:
            raise ClientError.from_call(rpc_error) from rpc_error  # type: ignore[arg-type]

    def _timeout(self, override: float | None | EllipsisType) -> float | None:
        return resolve_timeout(override, self.timeout_s)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Wait until the coordinator's ``grpc.health.v1`` status is SERVING (it is once a
        decode worker registered); ``ClientError`` DEADLINE_EXCEEDED after ``timeout_s``."""
        health = health_pb2_grpc.HealthStub(self._channel)
        check = health_pb2.HealthCheckRequest(service=wire.COORDINATOR_SERVICE)
        deadline = Deadline(timeout_s)
        last = "no answer"
        while (remaining := deadline.remaining() or 0.0) > 0:
            try:
                reply = health.Check(check, timeout=min(1.0, remaining), metadata=self._metadata)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as error:
                last = f"{error.code().name}: {error.details()}"  # type: ignore[attr-defined]
            time.sleep(min(HEALTH_POLL_S, deadline.remaining() or 0.0))
        raise ClientError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"coordinator at {self.target} not serving after {timeout_s} s (last: {last})",
        )

    def close(self) -> None:
        """Close the channel (if this client created it); running calls are cancelled."""
        if self._owns_channel:
            self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
