"""``AsyncClient``: the coordinator's public API for asyncio callers (the HTTP gateway).

Contracts, for every method:

- Deadline: each call gets ``timeout_s`` (the method's own argument, else the client's;
  None = no deadline). It covers all attempts and the waits between them; running out
  surfaces as ``ClientError`` with DEADLINE_EXCEEDED.
- Errors: every failure is a ``ClientError`` (status ``code``, ``message``, ``param`` from the
  trailing metadata ``splitserve-param`` or the in-stream ``Error.param``, ``retry_after_s``
  from ``retry-after-ms``).
- Retries (``RetryPolicy``), done by gRPC itself from the channel's service config (see
  ``splitserve.client.retry``): UNAVAILABLE, and RESOURCE_EXHAUSTED when ``retry_overloaded``
  (waiting the server's hint when given), with exponential backoff, at most ``max_attempts``
  attempts; a stream is never retried once a ``Chunk`` was delivered. Other codes are raised
  at once. A retried stream resends the same request, so its ``request_id`` (a uuid4 hex when
  the caller gives none) stays the one ``abort()`` can name.
- Coordinator failure: a stream whose coordinator dies (UNAVAILABLE, CANCELLED) after it
  delivered tokens goes on through another coordinator of the target (``connection.py``)
  from the tokens received (``continue_after``), up to ``continuation.MAX_CONTINUATIONS``
  times, within the same deadline: the consumer sees one stream, no token twice or missing
  (``continuation.StreamContinuation``, shared with ``Client``).
- Cancellation: when the consumer of ``stream()`` stops early (``break``, ``aclose()``, the
  task cancelled, the generator garbage collected) the gRPC call is cancelled and the
  coordinator aborts the request on every worker. For prompt release on ``break`` close the
  generator explicitly, e.g. ``async with contextlib.aclosing(client.stream(...)) as items``;
  an abandoned one is closed when garbage collected (asyncio then schedules its ``aclose()``).

The channel is created on first use, inside the running event loop, with the client's
``retry`` (fixed from then on) and ``credentials`` (TLS; see ``connection.py``), unless one
is passed in: then the caller owns it, ``close()``
leaves it open, and it retries as it was built (by a policy only when built with
``splitserve.client.retry.channel_options(policy)``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from types import EllipsisType, TracebackType
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.client import wire
from splitserve.client.beam_search import BeamResult, BeamSearchParams, served_beams
from splitserve.client.choices import choice_samplings, merged
from splitserve.client.connection import aio_channel, call_metadata
from splitserve.client.continuation import StreamContinuation
from splitserve.client.errors import DEFAULT_RETRY, ClientError, RetryPolicy
from splitserve.client.retry import Deadline, resolve_timeout
from splitserve.client.stream_mux import MultiplexedStream, StreamMultiplexer
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


class AsyncClient:
    """Typed asyncio client of a splitserve coordinator at ``target`` ("host:port");
    ``api_key`` and ``credentials`` (TLS): see ``splitserve.client.connection``."""

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        timeout_s: float | None = 600.0,
        retry: RetryPolicy = DEFAULT_RETRY,
        channel: grpc.aio.Channel | None = None,
        api_key: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        multiplexer: StreamMultiplexer | None = None,
    ) -> None:
        """``multiplexer``: ``stream()`` goes over its shared ``GenerateStreams`` calls
        (``stream_mux.py``; retried by the multiplexer's policy) instead of a ``Generate``
        call per stream."""
        self.target = target
        self._multiplexer = multiplexer
        self._metadata = call_metadata(api_key)
        self._formats: tuple[str, str] | None = None
        self._credentials = credentials
        self.timeout_s = timeout_s
        self.retry = retry
        self._channel = channel
        self._owns_channel = channel is None
        self._closed = False

    def _get_channel(self) -> grpc.aio.Channel:
        if self._closed:
            raise RuntimeError("the client is closed")
        if self._channel is None:
            self._channel = aio_channel(self.target, self._credentials, self.retry)
        return self._channel

    def _stub(self) -> coordinator_pb2_grpc.CoordinatorStub:
        return coordinator_pb2_grpc.CoordinatorStub(self._get_channel())

    async def stream(
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
    ) -> AsyncGenerator[Chunk | Finish, None]:
        """Stream a completion of exactly one of ``prompt`` (raw text), ``messages`` (chat,
        rendered with the model's template) or ``token_ids``: ``Chunk``s, then exactly one
        ``Finish``; raises ``ClientError``.

        An async generator: nothing happens until iteration starts, where wrong arguments
        raise ``ValueError`` / ``TypeError`` (not exactly one prompt, a malformed message) or
        ``ClientError`` INVALID_ARGUMENT (a sampling value the wire cannot carry).
        ``priority``: admission order among waiting requests, higher first (at most the key's
        tenant's ``max_priority``, else INVALID_ARGUMENT). ``targets``: this request's own
        latency targets for where its prompt is computed (None: the coordinator's).
        ``traceparent``: a W3C trace context (the ``traceparent`` header's value) whose trace
        the request's spans join, where the cluster traces (``common/tracing.py``).
        ``session_id``: the session (conversation, agent, user) it belongs to: every
        coordinator sends a session's requests to the same decode worker, where its earlier
        turns' KV is, while that worker has room. ``model``: the model asked for (""
        whatever the coordinator serves; another than it serves is NOT_FOUND).
        ``add_special_tokens`` (vLLM's): whether the prompt is tokenized with the
        tokenizer's special tokens (its BOS, where the model adds one); None: yes for
        ``prompt``, no for ``messages`` (the chat template writes its own).
        ``chat_template``: how ``messages`` are rendered (its variables, whether the
        generation prompt closes them or the final assistant message is continued).
        ``truncate_prompt_tokens``: keep only the prompt's last N tokens (-1: as many as the
        context takes); a prompt over the context is refused without it.
        """
        request = wire.generate_request(
            prompt, messages, token_ids, sampling, request_id, priority, targets, traceparent,
            session_id, model, add_special_tokens, chat_template, truncate_prompt_tokens,
        )  # fmt: skip
        stream = StreamContinuation(request, Deadline(self._timeout(timeout_s)), self._start)
        while stream.needs_call:
            with stream.next_call() as call:
                async for response in call:
                    if (chunk := stream.receive(response)) is not None:
                        yield chunk
        yield stream.finish()

    def _start(
        self, request: coordinator_pb2.GenerateRequest, timeout_s: float | None
    ) -> grpc.aio.UnaryStreamCall | MultiplexedStream:
        """One ``Generate`` call of a stream (``StreamContinuation``'s ``start``), or its
        multiplexed stand-in."""
        if self._multiplexer is not None:
            return self._multiplexer.start(request, timeout_s, self._metadata)
        return self._stub().Generate(request, timeout=timeout_s, metadata=self._metadata)

    async def generate(
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
        """The whole completion of ``stream()`` with the same arguments, joined. With
        ``tools`` (OpenAI's function tools; ``tool_choice`` none / auto / required / a named
        function, ``parallel_tool_calls``; a chat only) the tools are described to the model
        and a forced choice constrains its answer, as the gateway does (``client/tools.py``);
        the calls it makes come back as ``Generation.tool_calls`` with finish reason
        ``tool_calls``. Malformed tools raise ``InvalidRequestError`` (a ``ValueError``)."""
        tool_format, reasoning_format = await self._served_formats()
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
        async with contextlib.aclosing(items):
            async for item in items:
                if isinstance(item, Finish):
                    return with_tool_calls(
                        Generation.of(chunks, item), asked.plan, reasoning_format
                    )
                chunks.append(item)
        raise AssertionError("unreachable: stream() ends with a Finish or raises")

    async def abort(self, request_id: str, *, timeout_s: float | None | EllipsisType = ...) -> bool:
        """Abort a running request by id (idempotent): its stream ends with finish_reason
        "abort". False when no such request is running."""
        reply = await self._unary(
            self._stub().Abort, coordinator_pb2.AbortRequest(request_id=request_id), timeout_s
        )
        return reply.aborted

    async def generate_choices(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[wire.MessageLike] | None = None,
        token_ids: Sequence[int] | None = None,
        sampling: Sampling | None = None,
        n: int = 1,
        best_of: int | None = None,
        request_id: str | None = None,
        priority: int = 0,
        targets: LatencyTargets | None = None,
        timeout_s: float | None | EllipsisType = ...,
        traceparent: str = "",
        session_id: str = "",
        model: str = "",
        add_special_tokens: bool | None = None,
    ) -> list[Generation]:
        """``n`` completions of one prompt, as one prompt computed once and forked
        (``client/choices.py``): choice ``j`` samples with ``sampling.seed + j`` (so it equals
        ``generate`` with that seed), starts once choice 0 has streamed, and all share one
        session (``session_id``, else one made from the request id), so they decode on one
        worker and share the prompt's KV blocks. Request ids are ``<request_id>-<j>``.
        ``best_of`` (at least ``n``): that many candidates, of which the ``n`` with the highest
        cumulative logprob of their tokens return, best first (their logprobs are asked for
        when ``sampling`` asks none). Other arguments as ``stream``; raises ``ValueError`` for
        ``n < 1`` or ``best_of < n`` and ``ClientError`` as ``stream`` does."""
        count = n if best_of is None else best_of
        if n < 1 or count < n:
            raise ValueError(f"n must be at least 1 and best_of at least n (n={n}, {best_of=})")
        base = sampling or Sampling()
        if best_of is not None and base.logprobs is None:
            base = dataclasses.replace(base, logprobs=0)
        request_id = request_id or wire.new_request_id()
        session = session_id or f"{request_id}-choices"
        streams = [
            self.stream(
                prompt,
                messages=messages,
                token_ids=token_ids,
                sampling=choice,
                request_id=f"{request_id}-{j}",
                priority=priority,
                targets=targets,
                timeout_s=timeout_s,
                traceparent=traceparent,
                session_id=session,
                model=model,
                add_special_tokens=add_special_tokens,
            )  # fmt: skip
            for j, choice in enumerate(choice_samplings(base, count))
        ]
        generations = await _gather(streams, count)
        if best_of is None:
            return generations
        ranked = sorted(generations, key=lambda g: -sum(entry.logprob for entry in g.logprobs))
        return ranked[:n]

    async def beam_search(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[wire.MessageLike] | None = None,
        token_ids: Sequence[int] | None = None,
        params: BeamSearchParams,
        request_id: str | None = None,
        model: str = "",
        add_special_tokens: bool | None = None,
        skip_special_tokens: bool = True,
    ) -> list[BeamResult]:
        """The ``params.width`` best beams after exactly one of ``prompt``, ``messages`` or
        ``token_ids`` (``client/beam_search.py``), best first, each with its text. Its step
        requests are ``<request_id>-beam-<k>``, in one session; raises ``ClientError`` as
        ``generate`` does."""
        request_id = request_id or wire.new_request_id()
        if token_ids is None:
            token_ids = await self.tokenize(
                prompt, messages=messages, add_special_tokens=add_special_tokens
            )
        eos_token_ids = (await self.model_info()).eos_token_ids
        beams = await served_beams(
            self, token_ids, params, eos_token_ids, request_id=request_id, model=model,
            session_id=f"{request_id}-beams",
        )  # fmt: skip
        texts = [
            await self.detokenize(beam.token_ids, skip_special_tokens=skip_special_tokens)
            for beam in beams
        ]
        return [BeamResult(beam, text) for beam, text in zip(beams, texts, strict=True)]

    async def _served_formats(self) -> tuple[str, str]:
        """The served model's tool-call and reasoning formats (``ModelInfo``), asked once:
        they hold for the coordinator's life."""
        if self._formats is None:
            info = await self.model_info()
            self._formats = (info.tool_call_format, info.reasoning_format)
        return self._formats

    async def model_info(self, *, timeout_s: float | None | EllipsisType = ...) -> ModelInfo:
        """The served model: name, context window, vocabulary, EOS ids, dtype."""
        reply = await self._unary(
            self._stub().GetModelInfo, coordinator_pb2.GetModelInfoRequest(), timeout_s
        )
        return wire.model_info(reply)

    async def load_lora_adapter(
        self,
        name: str,
        path: str,
        *,
        load_inplace: bool = False,
        timeout_s: float | None | EllipsisType = ...,
    ) -> LoadedAdapter:
        """Serve the LoRA adapter in folder ``path`` (on the workers, under their
        ``--lora-dir``) as ``name`` on every worker of the model, or on none
        (``coordinator/runtime_adapters.py``); requests name it as their model from then
        on. ``load_inplace``: where ``name`` is served with other files, these replace them
        (checked on every worker first; requests running finish with the old files).
        PERMISSION_DENIED unless the key's tenant is among the coordinator's
        ``--lora-admin-tenants`` (where keys are required)."""
        request = coordinator_pb2.LoadLoraAdapterRequest(
            lora_name=name, lora_path=path, load_inplace=load_inplace
        )
        reply = await self._unary(self._stub().LoadLoraAdapter, request, timeout_s)
        return LoadedAdapter(reply.adapter.name, reply.adapter.digest, reply.workers)

    async def unload_lora_adapter(
        self, name: str, *, timeout_s: float | None | EllipsisType = ...
    ) -> int:
        """Stop serving the LoRA adapter ``name`` on every worker (requests of it already
        running finish); how many worker processes served it. NOT_FOUND where none did."""
        request = coordinator_pb2.UnloadLoraAdapterRequest(lora_name=name)
        return (await self._unary(self._stub().UnloadLoraAdapter, request, timeout_s)).workers

    async def tokenize(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[wire.MessageLike] | None = None,
        add_special_tokens: bool | None = None,
        timeout_s: float | None | EllipsisType = ...,
        chat_template: ChatTemplate | None = None,
    ) -> list[int]:
        """The token ids ``stream`` would send the model for exactly one of ``prompt`` or
        ``messages`` (rendered with the model's chat template, generation prompt appended),
        ``add_special_tokens`` as there."""
        request = wire.tokenize_request(prompt, messages, add_special_tokens, chat_template)
        reply = await self._unary(self._stub().Tokenize, request, timeout_s)
        return list(reply.token_ids)

    async def detokenize(
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
        return (await self._unary(self._stub().Detokenize, request, timeout_s)).text

    async def _unary(
        self,
        method: Callable[..., Awaitable[Reply]],
        request: object,
        timeout_s: float | None | EllipsisType,
    ) -> Reply:
        try:
            return await method(request, timeout=self._timeout(timeout_s), metadata=self._metadata)
        except grpc.aio.AioRpcError as rpc_error:
            raise ClientError.from_call(rpc_error) from rpc_error

    def _timeout(self, override: float | None | EllipsisType) -> float | None:
        return resolve_timeout(override, self.timeout_s)

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Wait until the coordinator's ``grpc.health.v1`` status is SERVING (it is once a
        decode worker registered); ``ClientError`` DEADLINE_EXCEEDED after ``timeout_s``."""
        health = health_pb2_grpc.HealthStub(self._get_channel())
        check = health_pb2.HealthCheckRequest(service=wire.COORDINATOR_SERVICE)
        deadline = Deadline(timeout_s)
        last = "no answer"
        while (remaining := deadline.remaining() or 0.0) > 0:
            try:
                reply = await health.Check(
                    check, timeout=min(1.0, remaining), metadata=self._metadata
                )
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.aio.AioRpcError as error:
                last = f"{error.code().name}: {error.details()}"
            await asyncio.sleep(min(HEALTH_POLL_S, deadline.remaining() or 0.0))
        raise ClientError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"coordinator at {self.target} not serving after {timeout_s} s (last: {last})",
        )

    async def close(self) -> None:
        """Close the channel (if this client created it); running calls are cancelled."""
        self._closed = True
        if self._owns_channel and self._channel is not None:
            await self._channel.close()
        self._channel = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()


async def _gather(
    streams: list[AsyncGenerator[Chunk | Finish, None]], count: int
) -> list[Generation]:
    """Each choice's ``Generation`` from its stream, the streams merged as ``generate_choices``
    forks them (choice 0 first, each other once it has streamed); ``ClientError`` INTERNAL
    for a stream that ended without its ``Finish``."""
    chunks: list[list[Chunk]] = [[] for _ in streams]
    finishes: list[Finish | None] = [None] * len(streams)
    async with contextlib.aclosing(merged(streams, [None] + [0] * (count - 1))) as items:
        async for index, item in items:
            if isinstance(item, Finish):
                finishes[index] = item
            else:
                chunks[index].append(item)
    generations = []
    for index, finish in enumerate(finishes):
        if finish is None:  # a stream ends with its Finish or raises
            raise ClientError(grpc.StatusCode.INTERNAL, f"choice {index} ended unfinished")
        generations.append(Generation.of(chunks[index], finish))
    return generations
