"""The OpenAI-compatible ASGI app over the coordinators' gRPC API: each request goes to the
coordinators of the model it names (``gateway/model_routes.py``).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses`` (one
handler, ``_generate``, by what differs between them: ``gateway/endpoints.py``; streamed when
``stream`` is true as SSE ``data: {json}\\n\\n`` ... ``data: [DONE]``, the Responses API as
typed events), ``GET /v1/models`` (every
model of every route), ``GET /health`` (200 once some model's coordinators are SERVING, i.e.
have a decode worker; else 503),
``GET /metrics`` (Prometheus text), and vLLM's ``POST /tokenize`` (the ids a prompt or chat
becomes, through the coordinator's ``Tokenize``), ``POST /detokenize`` and ``GET /version``;
the stored responses' ``GET``/``DELETE /v1/responses/{id}`` and its ``input_items``
(``gateway/response_routes.py``).

Contracts:
- Errors are OpenAI-shaped JSON with the matching status (``gateway/errors.py``). A request
  that fails before its first token gets that status even when streamed (the SSE response
  starts only with the first token); a failure after tokens were streamed ends the stream
  with a ``data: {"error": ...}`` event and ``data: [DONE]``.
- ``x-request-id`` names the request on every worker (generated when absent) and is echoed.
- ``x-session-id`` names its session: a session's requests go to one decode worker while it
  has room (``coordinator/router.py``).
- With API keys, requests without a valid ``Authorization: Bearer <key>`` get 401
  (``gateway/api_key_check.py``); the caller's bearer key goes on to the coordinator with
  each call (``Gateway.client_for``), whichever keys the gateway holds itself.
- A client that disconnects aborts its request (``gateway/disconnect.py``).
- Every error, Starlette's own included (unknown route 404, wrong method 405, unparseable
  body 400, a body over ``max_body_bytes`` 413), has the OpenAI error body; a string with a
  lone UTF-16 surrogate is a 400 naming its field (``schemas.unencodable_string_path``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.metadata
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.trace import Span, SpanKind, StatusCode
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from splitserve.client import (
    AsyncClient,
    Chunk,
    ClientError,
    Finish,
    LatencyTargets,
    RetryPolicy,
    Sampling,
)
from splitserve.client.beam_search import served_beams
from splitserve.client.choices import choice_samplings, merged
from splitserve.client.connection import call_metadata
from splitserve.client.stream_mux import OpenStreams
from splitserve.common.api_keys import ApiKeys
from splitserve.common.prompt import truncated
from splitserve.common.response_store import MemoryResponseStore, ResponseStore
from splitserve.common.tracing import active_span, start_span, traceparent_of
from splitserve.gateway import schemas
from splitserve.gateway.adapter_routes import add_adapter_routes
from splitserve.gateway.api_key_check import RequireApiKey, bearer_key
from splitserve.gateway.background import BackgroundRuns
from splitserve.gateway.beam_choices import PromptBeams, beam_search_params
from splitserve.gateway.body_limit import LimitBody
from splitserve.gateway.choices import Choices
from splitserve.gateway.conversation_routes import add_conversation_routes
from splitserve.gateway.conversations import Conversations
from splitserve.gateway.defaults import (
    CLIENT_STALL_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    STORED_RESPONSES_MEMORY_BYTES,
    STORED_RESPONSES_TTL_S,
)
from splitserve.gateway.edge_refusal import RefuseAtTheDoor
from splitserve.gateway.endpoints import CHAT, COMPLETIONS, RESPONSES, Body, Endpoint
from splitserve.gateway.errors import (
    ApiError,
    client_errors_as_api_errors,
    from_client_error,
    from_http_exception,
    from_validation_error,
)
from splitserve.gateway.model_routes import ModelRoute, ModelRoutes
from splitserve.gateway.reply import respond
from splitserve.gateway.response_routes import (
    add_response_routes,
    conversation_session,
    read_previous,
    run_in_background,
)
from splitserve.gateway.response_turn import ResponseTurn
from splitserve.gateway.responses import PromptShown
from splitserve.gateway.responses_events import ResponsesBuilder
from splitserve.gateway.responses_schemas import ResponsesRequest
from splitserve.gateway.sampling import (
    MAX_CHOICES,
    PromptArgs,
    asked_template_fields,
    best_of_asked,
    chat_messages,
    chat_template_of,
    check_wire_token_ids,
    serve_model_formats,
    tokenized_tools,
)
from splitserve.gateway.stored_responses import (
    StoredResponses,
)
from splitserve.gateway.token_names import named_by_id_stream
from splitserve.gateway.unserved_fields import UnservedFields

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": schemas.ErrorResponse} for status in (400, 404, 429, 500, 503, 504)
}
try:
    SPLITSERVE_VERSION = importlib.metadata.version("splitserve")
except importlib.metadata.PackageNotFoundError:  # a checkout run without its install
    SPLITSERVE_VERSION = "unknown"
_Handler = Callable[..., Awaitable[Response]]
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewayConfig:
    coordinators: tuple[str, ...] = ("127.0.0.1:50051",)
    """One target per model: that model's coordinators (an address, a comma-separated list
    or a DNS name); the gateway routes each request by its ``model``
    (``gateway/model_routes.py``)."""
    served_model_names: tuple[str, ...] = ()
    """Names clients may send as ``model`` (one target only); empty: the coordinators'."""
    request_timeout_s: float = 3600.0
    api_keys: ApiKeys = ApiKeys()
    """Keys HTTP callers must present (none: anyone may call)."""
    health_needs_key: bool = False
    """With keys: /health and /metrics ask for one too."""
    coordinator_credentials: grpc.ChannelCredentials | None = None
    """TLS to the coordinator (None: plaintext)."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """Larger request bodies get 413 (``gateway/body_limit.py``)."""
    relay: str = "multiplexed"
    """How streams reach the coordinator: ``multiplexed`` (many on each ``GenerateStreams``
    call, ``client/stream_mux.py``) or ``per-stream`` (a ``Generate`` call each)."""
    client_stall_timeout_s: float = CLIENT_STALL_TIMEOUT_S
    """An SSE write an HTTP client leaves unread this long ends its stream (and request)."""
    local_streams: OpenStreams | None = None
    """The single coordinator runs in this process (``splitserve frontend``): streams reach
    it through this, without gRPC (``proto/local_streams.py``)."""
    response_store: ResponseStore | None = field(
        default_factory=lambda: MemoryResponseStore(STORED_RESPONSES_MEMORY_BYTES)
    )
    """Where the Responses API's stored responses live (None: none are stored;
    ``gateway/stored_responses.py``); closed with the gateway."""
    response_ttl_s: float = STORED_RESPONSES_TTL_S
    """How long a stored response is kept."""
    drain_timeout_s: float = 30.0
    """On shutdown, how long background responses may take to end before they are cancelled
    (``gateway/background.py``)."""


def _post(app: FastAPI, endpoint: Endpoint[Any]) -> Callable[[_Handler], _Handler]:
    """Registers a generation route's handler at ``endpoint.path``, with its OpenAPI
    responses: its errors, and 200 as JSON or, with ``stream``, as SSE events."""
    ok = {"description": endpoint.description, "content": {"text/event-stream": {}}}
    return app.post(
        endpoint.path,
        response_model=endpoint.response_model,
        responses={**_ERROR_RESPONSES, 200: ok},
    )


class Gateway:
    """Per-process state: the model routes (a channel to each model's coordinators, their
    names), metrics."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.registry = CollectorRegistry()
        # Overload is the caller's to retry (HTTP 429 + Retry-After); lost workers are retried.
        self.models = ModelRoutes.open(
            config.coordinators,
            config.coordinator_credentials,
            RetryPolicy(retry_overloaded=False),
            config.relay == "multiplexed",
            self.registry,
            config.served_model_names,
            config.local_streams,
        )
        self.http_requests = Counter(
            "splitserve_http_requests",
            "HTTP requests by route and status code.",
            ["route", "status"],
            registry=self.registry,
        )
        self.ignored_fields = Counter(
            "splitserve_ignored_request_fields",
            "Request fields the gateway ignored (gateway/unserved_fields.py), by name for "
            "the known ones, else 'other'.",
            ["field"],
            registry=self.registry,
        )
        self.unserved_fields = UnservedFields()
        self.stored_responses = StoredResponses(
            config.response_store, config.response_ttl_s, self.registry
        )
        self.background = BackgroundRuns(self.stored_responses, self.registry)
        self.conversations = Conversations(self.stored_responses)

    def tenant_of(self, request: Request) -> str:
        """The tenant of the HTTP caller's key ("" for anonymous callers: no keys)."""
        caller = self.config.api_keys.caller_of(request.headers.get("authorization"))
        return "" if caller is None else caller.tenant

    def client_for(self, request: Request, route: ModelRoute) -> AsyncClient:
        """A client of ``route``'s shared channel whose calls carry the HTTP caller's bearer
        key."""
        return AsyncClient(
            route.target,
            timeout_s=self.config.request_timeout_s,
            channel=route.channel,
            api_key=bearer_key(request.headers.get("authorization")),
            multiplexer=route.multiplexer,
        )

    async def route(self, model: str | None, request: Request) -> ModelRoute:
        """The route of the model ``model`` names (None: the first), asked as the HTTP
        caller; ``ApiError`` 404 / 503 (``gateway/model_routes.py``)."""
        return await self.models.route(model, lambda route: self.client_for(request, route))

    def edge_refusal(self, authorization: str | None) -> ApiError | None:
        """The 429 a generation request with this ``Authorization`` value gets without being
        read: where the gateway serves one model route and every call its key's streams
        would take has been told its coordinator refuses every new request for now
        (``StreamMultiplexer.refusal_for``); else None (``gateway/edge_refusal.py``)."""
        if len(self.models.routes) != 1:
            return None
        multiplexer = self.models.routes[0].multiplexer
        if multiplexer is None:
            return None
        refusal = multiplexer.refusal_for(call_metadata(bearer_key(authorization)))
        return None if refusal is None else from_client_error(ClientError.from_call(refusal))

    def count_ignored(self, body: BaseModel) -> None:
        """Refuse (``ApiError`` 400) or count the fields ``body`` has that the gateway does not
        serve (``gateway/unserved_fields.py``)."""
        for label in self.unserved_fields.check(body):
            self.ignored_fields.labels(label).inc()

    async def ready(self, request: Request) -> bool:
        """Whether some model's coordinators are SERVING (have a decode worker), asked with
        the HTTP caller's key (if it needs one): the gateway can serve something."""
        metadata = call_metadata(bearer_key(request.headers.get("authorization")))
        answers = await asyncio.gather(
            *(_serving(route.channel, metadata) for route in self.models.routes)
        )
        return any(answers)

    async def close(self) -> None:
        await self.background.drain(self.config.drain_timeout_s)
        await self.models.close()
        await self.stored_responses.close()

    async def cards(self, request: Request) -> list[dict[str, Any]]:
        """``/v1/models``' entries: every name of every model whose coordinators answered,
        then each LoRA adapter they serve now, naming its base model as ``parent``."""
        client_of = lambda route: self.client_for(request, route)  # noqa: E731
        known = await self.models.known(client_of)
        await self.models.refresh_adapters(client_of)
        cards = []
        for route in known:
            window = route.info.max_model_len if route.info else 0
            card = {"object": "model", "created": 0, "owned_by": "splitserve"}
            cards.extend({**card, "id": name, "max_model_len": window} for name in route.names)
            cards.extend(
                {
                    **card,
                    "id": name,
                    "max_model_len": window,
                    "root": name,
                    "parent": route.names[0],
                }
                for name in route.adapters
            )
        return cards


async def _serving(channel: grpc.aio.Channel, metadata: Any) -> bool:  # noqa: ANN401
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0, metadata=metadata)
    except grpc.aio.AioRpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def create_app(config: GatewayConfig) -> FastAPI:
    """The app; its ``Gateway`` (gRPC channels) is made on startup, on the serving loop."""
    gateway: Gateway

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal gateway
        gateway = app.state.gateway = Gateway(config)
        yield
        await gateway.close()

    def current() -> Gateway:
        return gateway

    app = FastAPI(
        title="splitserve OpenAI-compatible API",
        version="1",
        description="Completions and chat completions over splitserve's coordinator.",
        lifespan=lifespan,
    )
    _answer_errors_openai_style(app)
    _add_middleware(app, config)
    _add_service_routes(app, current)
    _add_token_routes(app, current)
    add_adapter_routes(app, current, _ERROR_RESPONSES)
    add_response_routes(app, current, _ERROR_RESPONSES)
    add_conversation_routes(app, current, _ERROR_RESPONSES)

    @app.get("/version", response_model=schemas.VersionResponse)
    async def version() -> dict[str, str]:
        return {"version": SPLITSERVE_VERSION}

    @_post(app, COMPLETIONS)
    async def completions(body: schemas.CompletionRequest, request: Request) -> Response:
        return await _generate(gateway, request, body, COMPLETIONS)

    @_post(app, CHAT)
    async def chat_completions(body: schemas.ChatCompletionRequest, request: Request) -> Response:
        return await _generate(gateway, request, body, CHAT)

    @_post(app, RESPONSES)
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await _generate(gateway, request, body, RESPONSES)

    return app


def _answer_errors_openai_style(app: FastAPI) -> None:
    """Every error in OpenAI's shape: ``ApiError``'s own, validation (400), Starlette's
    (404, 405, ...), and anything unexpected (500, logged)."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return error.response()

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unexpected error serving %s", request.url.path)
        return ApiError(
            500, f"internal error: {type(error).__name__}", type="server_error"
        ).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return from_validation_error(error).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return from_http_exception(error).response()


def _add_middleware(app: FastAPI, config: GatewayConfig) -> None:
    """The middleware a request passes, in this order: the response count, the API-key check
    (401), the edge refusal (429, body unread), the body limit (413); added innermost first,
    as Starlette wraps each added one around the app so far."""
    app.add_middleware(LimitBody, max_bytes=config.max_body_bytes)
    app.add_middleware(
        RefuseAtTheDoor,
        paths=frozenset({COMPLETIONS.path, CHAT.path, RESPONSES.path}),
        refusal=_edge_refusal,
    )
    app.add_middleware(
        RequireApiKey, keys=config.api_keys, health_needs_key=config.health_needs_key
    )
    app.add_middleware(_CountRequests)


def _add_service_routes(app: FastAPI, current: Callable[[], Gateway]) -> None:
    """``/health``, ``/metrics`` and ``/v1/models``, over the app's gateway (``current``:
    made on startup)."""

    @app.get(
        "/health",
        response_class=Response,
        responses={
            200: {"description": "Ready (empty body)."},
            503: {"description": "Not ready.", "model": schemas.ErrorResponse},
        },
    )
    async def health(request: Request) -> Response:
        """200 with an empty body once the coordinator has a decode worker, else 503 with
        the OpenAI error body."""
        if await current().ready(request):
            return Response(status_code=200)
        return JSONResponse(
            ApiError(503, "no decode worker is ready", type="service_unavailable").body(),
            status_code=503,
        )

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(generate_latest(current().registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=schemas.ModelList, responses=_ERROR_RESPONSES)
    async def models(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": await current().cards(request)}


def _add_token_routes(app: FastAPI, current: Callable[[], Gateway]) -> None:
    """vLLM's ``/tokenize`` and ``/detokenize``, through the routed model's coordinators
    (``current``: the app's gateway, made on startup)."""

    @app.post("/tokenize", response_model=schemas.TokenizeResponse, responses=_ERROR_RESPONSES)
    async def tokenize(body: schemas.TokenizeRequest, request: Request) -> dict[str, Any]:
        """vLLM's: the ids the model sees for ``prompt`` or ``messages`` (chat template and
        generation prompt applied, ``add_special_tokens`` as in a generation request), as a
        generation request would send them."""
        gateway = current()
        gateway.count_ignored(body)
        route = await gateway.route(body.model, request)
        client = gateway.client_for(request, route)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt or messages", param="prompt")
        messages = None if body.messages is None else chat_messages(body.messages)
        template = chat_template_of(body)
        if template is not None and messages is None:
            asked = [name for name, value in asked_template_fields(body) if value]
            raise ApiError(400, "the chat template renders messages, not a prompt", param=asked[0])
        if body.tools:
            if messages is None:
                raise ApiError(400, "tools are shown in a chat: give messages", param="tools")
            assert route.info is not None  # known: routed by it
            messages, template = tokenized_tools(
                messages, template, body.tools, route.info.tool_call_format
            )
        with client_errors_as_api_errors():
            ids = await client.tokenize(
                body.prompt,
                messages=messages,
                add_special_tokens=body.add_special_tokens,
                chat_template=template,
            )
        assert route.info is not None  # known: routed by it
        return {"count": len(ids), "max_model_len": route.info.max_model_len, "tokens": ids}

    @app.post("/detokenize", response_model=schemas.DetokenizeResponse, responses=_ERROR_RESPONSES)
    async def detokenize(body: schemas.DetokenizeRequest, request: Request) -> dict[str, Any]:
        """vLLM's: the text of ``tokens`` (special tokens kept)."""
        gateway = current()
        gateway.count_ignored(body)
        check_wire_token_ids(body.tokens, "tokens", "tokens")
        client = gateway.client_for(request, await gateway.route(body.model, request))
        with client_errors_as_api_errors():
            return {"prompt": await client.detokenize(body.tokens)}


def _edge_refusal(scope: Scope, authorization: str | None) -> ApiError | None:
    """``Gateway.edge_refusal`` of the app serving ``scope`` (None before its start-up)."""
    gateway: Gateway | None = getattr(scope["app"].state, "gateway", None)
    return None if gateway is None else gateway.edge_refusal(authorization)


class _CountRequests:
    """ASGI middleware counting responses by route and status (no body buffering, so SSE
    streams and disconnect detection pass through untouched)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                gateway: Gateway | None = getattr(scope["app"].state, "gateway", None)
                route = getattr(scope.get("route"), "path", "unmatched")
                if gateway is not None:
                    gateway.http_requests.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def _id_header(request: Request, name: str) -> str:
    """The id header ``name`` ("" when absent); 400 naming it past 256 characters."""
    given = request.headers.get(name, "").strip()
    if len(given) > 256:
        raise ApiError(400, f"{name} must be at most 256 characters", param=name)
    return given


def _request_id(request: Request, body: Body) -> str:
    """The request's id: the ``x-request-id`` header's, else the body's ``request_id``
    (vLLM's field; the header wins, as in vLLM), else a new one."""
    asked = getattr(body, "request_id", None)
    return _id_header(request, "x-request-id") or (asked or "").strip() or uuid.uuid4().hex


async def _generate(
    gateway: Gateway, request: Request, body: Body, endpoint: Endpoint[Body]
) -> Response:
    """The one generation handler, for every route: checks the model, names the request, reads
    prompts and sampling from ``body`` the ``endpoint``'s way, starts one stream per choice
    (prompts x ``n``: ``gateway/choices.py``) and answers in the endpoint's shape, whole or
    streamed (``gateway/reply.py:respond``)."""
    gateway.count_ignored(body)
    route = await gateway.route(body.model, request)
    assert route.info is not None and route.metrics is not None  # known: routed by it
    client = gateway.client_for(request, route)
    model = body.model or route.names[0]
    # the coordinator's name for it: its served name, or the LoRA adapter asked for
    asked_adapter = body.model in route.adapters and body.model not in route.names
    coordinator_model = body.model if asked_adapter else route.info.model
    request_id = _request_id(request, body)
    # a conversation's requests that carry one go to one decode worker (coordinator/router.py)
    session_id = _id_header(request, "x-session-id")
    serve_model_formats(body, route.info)
    responses_body = body if isinstance(body, ResponsesRequest) else None
    tenant = ""  # whose stored responses a Responses request reads and adds to
    if responses_body is not None:
        tenant = gateway.tenant_of(request)
        await read_previous(gateway.stored_responses, gateway.conversations, responses_body, tenant)
    prompts = endpoint.prompts(body)
    keep_best = best_of_asked(body)  # then best_of candidates per prompt, n of them kept
    samplings = choice_samplings(endpoint.sampling(body), keep_best or body.n)
    if len(prompts) * len(samplings) > MAX_CHOICES:
        raise ApiError(400, f"at most {MAX_CHOICES} choices (prompts x n)", param="n")
    beam_params = beam_search_params(body, samplings[0]) if body.use_beam_search else None
    if beam_params is None and body.length_penalty not in (None, 1.0):
        raise ApiError(400, "length_penalty is only used by beam search", param="length_penalty")
    shown = await _prompts_shown(client, body, prompts, route.info.max_model_len)
    response_id = f"{endpoint.id_prefix}-{request_id}"
    if responses_body is not None:  # a stored conversation's turns go to one decode worker
        session_id = conversation_session(responses_body, session_id, response_id)
    span = _request_span(request, request_id, endpoint)
    traceparent = traceparent_of(span)
    builders, prompt_of, streams, leaders = [], [], [], []
    if beam_params is not None:
        keep_best = None  # the search keeps its n best beams itself
        for p, prompt in enumerate(prompts):
            ids = await _prompt_token_ids(client, body, prompt, route.info.max_model_len)
            beams = PromptBeams(
                functools.partial(
                    served_beams, client, ids, beam_params, route.info.eos_token_ids,
                    request_id=f"{request_id}-{p}", model=coordinator_model,
                    session_id=session_id or f"{response_id}-{p}",
                    priority=-(body.priority or 0), traceparent=traceparent,
                    cache_salt=samplings[0].cache_salt,
                ),
                client, len(ids), samplings[0].skip_special_tokens is not False,
            )  # fmt: skip
            for j in range(beam_params.width):
                index = p * beam_params.width + j
                builders.append(endpoint.builder(response_id, model, body, index, shown[p]))
                prompt_of.append(p)
                leaders.append(None)
                streams.append(beams.choice(j, f"{request_id}-{index}"))
    for p, prompt in enumerate(prompts if beam_params is None else ()):
        # a prompt's choices fork from its first: one session, so one decode worker
        fork_session = session_id or (f"{response_id}-{p}" if len(samplings) > 1 else "")
        for j, sampling in enumerate(samplings):
            index = p * len(samplings) + j
            builders.append(endpoint.builder(response_id, model, body, index, shown[p]))
            prompt_of.append(p)
            leaders.append(None if j == 0 else p * len(samplings))
            choice_id = (
                request_id if len(prompts) * len(samplings) == 1 else f"{request_id}-{index}"
            )
            streams.append(
                _choice_stream(
                    client, body, prompt, sampling, choice_id, fork_session, traceparent,
                    coordinator_model,
                )
            )  # fmt: skip
    choices = Choices(builders, prompt_of, None if keep_best is None else body.n or 1)
    finished = None
    if responses_body is not None:
        assert isinstance(builders[0], ResponsesBuilder)  # a response has one output
        turn = ResponseTurn(
            gateway.stored_responses, gateway.conversations, responses_body, builders[0],
            tenant, session_id,
        )  # fmt: skip
        if responses_body.background:  # one prompt, one choice: its stream made anew each try

            def open_events() -> AsyncGenerator[tuple[int, Chunk | Finish], None]:
                stream = _choice_stream(
                    client, body, prompts[0], samplings[0], request_id, session_id,
                    traceparent, coordinator_model,
                )  # fmt: skip
                return merged([stream], [None])

            return await run_in_background(
                gateway.background, turn, open_events, choices, route.metrics, span,
                request_id, gateway.config.client_stall_timeout_s,
            )  # fmt: skip
        finished = turn.ending()
    try:
        usage_options = body.stream_options if endpoint.usage_chunks else None
        return await respond(
            route.metrics, request, request_id, merged(streams, leaders), choices,
            bool(body.stream), usage_options, gateway.config.client_stall_timeout_s, span,
            endpoint.framing, finished,
        )  # fmt: skip
    except BaseException as error:
        _note_failure(span, error, body.priority)
        if responses_body is not None and isinstance(error, ApiError):
            error.param = RESPONSES_PARAMS.get(error.param or "", error.param)
        raise


RESPONSES_PARAMS = {"reasoning_effort": "reasoning.effort", "max_tokens": "max_output_tokens"}
"""The Responses API's names of the chat fields a coordinator's refusal may name."""


def _request_span(request: Request, request_id: str, endpoint: Endpoint[Body]) -> Span:
    """The request's span: the client's ``traceparent`` honoured, under FastAPI's HTTP span
    (itself under the client's) if any; ended with the request by its timer, or by
    ``_note_failure`` when it fails before one starts."""
    return start_span(
        f"gateway {endpoint.path}",
        request_id,
        request.headers.get("traceparent", ""),
        parent=active_span(),
        kind=SpanKind.SERVER,
    )


def _choice_stream(
    client: AsyncClient,
    body: Body,
    prompt: PromptArgs,
    sampling: Sampling,
    request_id: str,
    session_id: str,
    traceparent: str,
    model: str,
) -> AsyncGenerator[Chunk | Finish, None]:
    """One choice's stream of ``prompt`` (nothing is sent before its first ``anext``), with
    the body's priority (vLLM's order, lower first) negated to gRPC's (higher first), its
    latency targets and ``add_special_tokens`` (unset: the coordinator's default for the
    prompt's kind); ``model``: the coordinator's name for it, which it checks it serves.
    With ``return_tokens_as_token_ids``, its logprobs name tokens by id
    (``gateway/token_names.py``)."""
    stream = client.stream(
        prompt.prompt,
        messages=prompt.messages,
        token_ids=prompt.token_ids,
        sampling=sampling,
        request_id=request_id,
        priority=-(body.priority or 0),
        targets=LatencyTargets(
            ttft_ms=body.ttft_slo_ms,
            tpot_ms=body.tpot_slo_ms,
            max_queue_wait_ms=body.max_queue_wait_ms,
        ),
        traceparent=traceparent,
        session_id=session_id,
        model=model,
        add_special_tokens=body.add_special_tokens,
        chat_template=prompt.chat_template,
        truncate_prompt_tokens=body.truncate_prompt_tokens,
    )
    return named_by_id_stream(stream) if body.return_tokens_as_token_ids else stream


def _note_failure(span: Span, error: BaseException, priority: int | None) -> None:
    """A generation request failed with ``error``: its span ends (unless its timer took it),
    and a refusal of its priority explains the two orders (the coordinator speaks gRPC's)."""
    if span.is_recording():  # failed before its timer took it
        span.set_status(StatusCode.ERROR, type(error).__name__)
        span.end()
    if isinstance(error, ApiError) and error.param == "priority":
        error.message += (
            f" (gRPC's order, higher first; this request's HTTP priority {priority} is "
            "vLLM's, lower first, sent to the coordinator negated)"
        )


async def _prompts_shown(
    client: AsyncClient, body: Body, prompts: list[PromptArgs], max_model_len: int
) -> list[PromptShown]:
    """What the response shows of each prompt: its text where the request asks for ``echo``
    (completions), its token ids where it asks for ``return_token_ids`` (those the
    coordinator's ``Tokenize`` gives, which are ``Generate``'s; a token-id prompt's own),
    both of the prompt as ``truncate_prompt_tokens`` leaves it (``common/prompt.py:truncated``,
    the coordinator's rule: the echoed text is then its kept tokens' text)."""
    echo = bool(getattr(body, "echo", False))
    want_ids = bool(getattr(body, "return_token_ids", False))
    keep = body.truncate_prompt_tokens
    shown = []
    for prompt in prompts:
        ids, text = prompt.token_ids, ""
        if ids is not None or want_ids or (echo and keep is not None):
            ids = await _prompt_token_ids(client, body, prompt, max_model_len)
        with client_errors_as_api_errors():
            if echo:
                text = prompt.prompt if prompt.prompt is not None and keep is None else ""
                if not text:
                    text = await client.detokenize(ids or ())
        shown.append(PromptShown(text, ids if want_ids else None))
    return shown


async def _prompt_token_ids(
    client: AsyncClient, body: Body, prompt: PromptArgs, max_model_len: int
) -> tuple[int, ...]:
    """The ids the model is given for ``prompt``: a token-id prompt's own, else those the
    coordinator's ``Tokenize`` gives (``Generate``'s); as ``truncate_prompt_tokens`` leaves
    them (``common/prompt.py:truncated``, the coordinator's rule)."""
    ids = prompt.token_ids
    with client_errors_as_api_errors():
        if ids is None:
            ids = tuple(
                await client.tokenize(
                    prompt.prompt,
                    messages=prompt.messages,
                    add_special_tokens=body.add_special_tokens,
                    chat_template=prompt.chat_template,
                )
            )
    keep = body.truncate_prompt_tokens
    return ids if keep is None else tuple(truncated(list(ids), keep, max_model_len))
