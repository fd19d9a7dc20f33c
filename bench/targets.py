"""What a load run talks to: the ``Target`` protocol and its gRPC implementation.

A target turns one ``RequestSpec`` into a stream of ``StreamEvent``s: one per message that
carries output tokens (``num_tokens`` > 0), then one final event with the finish reason or
an error. The load generator stamps each event with its arrival time; a target does no
timing itself. A target never raises for a request's failure (status error, broken stream):
it reports it as a final event with ``error`` set, so one failed request never stops a run.

``GrpcTarget`` speaks ``splitserve.v1.Coordinator.Generate`` with the prompt as token ids and
``max_tokens = min_tokens = output_len``, ``ignore_eos``, greedy: every request generates
exactly its output length. ``OpenAITarget`` sends the same request to any OpenAI-compatible
server's streamed ``/v1/completions`` (splitserve's gateway, vLLM, SGLang, ...), counting
tokens from the per-chunk usage (``continuous_usage_stats``, a vLLM extension splitserve's
gateway also speaks) or, without it, one token per non-empty chunk. It can present an API key
(``authorization: Bearer <key>``) and verify an HTTPS server against a given ``ssl`` context.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import grpc
import httpx
from workload import RequestSpec

from splitserve.proto.splitserve.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc


@dataclass(frozen=True)
class StreamEvent:
    """One message of a request's stream, as the load generator sees it."""

    num_tokens: int = 0
    """Output tokens this message carries (0 on the final event)."""
    text: str = ""
    """The output text it carries (``OpenAITarget``; empty from ``GrpcTarget``)."""
    finish_reason: str | None = None
    """Set on the final event of a request that finished (e.g. ``length``, ``stop``)."""
    error: str | None = None
    """Set on the final event of a request that failed."""

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class Target(Protocol):
    """An API endpoint the load generator can drive; ``open`` before and ``close`` after."""

    name: str

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    def stream(self, request: RequestSpec) -> AsyncIterator[StreamEvent]:
        """The request's events; the last one is ``final`` (it may be the only one)."""
        ...


_FINISH_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


class GrpcTarget:
    """The coordinator's gRPC ``Generate`` over one shared ``grpc.aio`` channel."""

    def __init__(self, address: str, timeout_s: float = 600.0) -> None:
        self.name = f"grpc://{address}"
        self.address = address
        self.timeout_s = timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._stub: coordinator_pb2_grpc.CoordinatorStub | None = None

    async def open(self) -> None:
        self._channel = grpc.aio.insecure_channel(self.address)
        await self._channel.channel_ready()
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub = None

    async def stream(self, request: RequestSpec) -> AsyncIterator[StreamEvent]:
        assert self._stub is not None, "open() the target first"
        message = coordinator_pb2.GenerateRequest(
            request_id=f"loadgen-{request.index}",
            token_ids=common_pb2.TokenIds(ids=request.prompt_token_ids),
            sampling=common_pb2.SamplingParams(
                max_tokens=request.output_len,
                min_tokens=request.output_len,
                temperature=0.0,
                ignore_eos=True,
            ),
        )
        try:
            async for response in self._stub.Generate(message, timeout=self.timeout_s):
                payload = response.WhichOneof("payload")
                if payload == "chunk":
                    if response.chunk.token_ids:
                        yield StreamEvent(num_tokens=len(response.chunk.token_ids))
                elif payload == "completion":
                    reason = response.completion.finish_reason
                    yield StreamEvent(finish_reason=_FINISH_NAMES.get(reason, str(reason)))
                    return
                elif payload == "error":
                    code, text = response.error.code, response.error.message
                    yield StreamEvent(error=f"in-stream error {code}: {text}")
                    return
        except grpc.aio.AioRpcError as error:
            yield StreamEvent(error=f"{error.code().name}: {error.details()}")
            return
        yield StreamEvent(error="stream ended without a completion")


class OpenAITarget:
    """A streamed ``POST {base_url}/v1/completions`` per request, over one HTTP client."""

    def __init__(
        self,
        base_url: str,
        model: str,
        timeout_s: float = 600.0,
        api_key: str | None = None,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        """``api_key``: sent as ``authorization: Bearer <key>``; ``verify``: how an HTTPS
        server is checked (an ``ssl.SSLContext`` trusting its CA, or httpx's default)."""
        self.name = base_url
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        self.headers = {} if api_key is None else {"authorization": f"Bearer {api_key}"}
        self.verify = verify
        self._http: httpx.AsyncClient | None = None

    async def open(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self._http = httpx.AsyncClient(
            timeout=self.timeout_s, limits=limits, headers=self.headers, verify=self.verify
        )

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
        self._http = None

    async def stream(self, request: RequestSpec) -> AsyncIterator[StreamEvent]:
        assert self._http is not None, "open() the target first"
        body = {
            "model": self.model,
            "prompt": list(request.prompt_token_ids),
            "max_tokens": request.output_len,
            "min_tokens": request.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        url = f"{self.base_url}/v1/completions"
        finish: str | None = None
        try:
            async with self._http.stream("POST", url, json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")[:300]
                    yield StreamEvent(error=f"HTTP {response.status_code}: {text}")
                    return
                seen = 0
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    message = json.loads(data)
                    if "error" in message:
                        yield StreamEvent(error=f"in-stream error: {message['error']}")
                        return
                    choices = message.get("choices") or []
                    usage = message.get("usage")
                    if usage is not None:
                        count = usage["completion_tokens"] - seen
                    else:
                        count = 1 if choices and choices[0].get("text") else 0
                    if count > 0 and choices:
                        seen += count
                        yield StreamEvent(num_tokens=count, text=choices[0].get("text") or "")
                    if choices and choices[0].get("finish_reason"):
                        finish = choices[0]["finish_reason"]
        except httpx.HTTPError as error:
            yield StreamEvent(error=f"{type(error).__name__}: {error}")
            return
        if finish is None:
            yield StreamEvent(error="stream ended without a finish reason")
        else:
            yield StreamEvent(finish_reason=finish)
