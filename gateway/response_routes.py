"""The Responses API's stored responses over HTTP, and what a generation request of it does
with them (``gateway/stored_responses.py`` holds the contract):

- ``GET /v1/responses/{response_id}``: the stored response object (404 for an unknown,
  expired, deleted or another tenant's id; ``include`` other than the logprobs one is a
  400); a background response's as it is now, or with ``stream`` its events after
  ``starting_after`` (``gateway/background.py``);
- ``POST /v1/responses/{response_id}/cancel``: a background response cancelled;
- ``DELETE /v1/responses/{response_id}``: ``{"id", "object": "response", "deleted": true}``;
- ``GET /v1/responses/{response_id}/input_items``: its input items a page at a time
  (``limit`` 1-100, default 20; ``order`` ``desc`` (default) or ``asc``; ``after`` an item
  id of the previous page; 400 naming ``after`` for an id not among them).

A ``POST /v1/responses`` reads the stored response its ``previous_response_id`` names before
its prompt is made (``read_previous``), goes to its conversation's session
(``conversation_session``) and is stored (and added to its conversation) before its last
event goes out (``gateway/response_turn.py:ResponseTurn.keep``), or,
``background``, is run apart from its HTTP request (``run_in_background``).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Annotated, Any, Protocol

from fastapi import Depends, FastAPI, Query, Request
from opentelemetry.trace import Span
from starlette.responses import JSONResponse, Response

from splitserve.client import Chunk, Finish
from splitserve.common.metrics import RequestMetrics
from splitserve.gateway.background import BackgroundRuns, answered, stale
from splitserve.gateway.choices import Choices
from splitserve.gateway.conversations import Conversations
from splitserve.gateway.disconnect import EventStreamResponse
from splitserve.gateway.errors import invalid
from splitserve.gateway.item_pages import PageQuery, asked_page
from splitserve.gateway.reply import TYPED_FRAMING, header_value
from splitserve.gateway.response_turn import ResponseTurn
from splitserve.gateway.responses_input import LOGPROBS_INCLUDE
from splitserve.gateway.responses_schemas import (
    InputItemList,
    ResponseDeleted,
    ResponseObject,
    ResponsesRequest,
)
from splitserve.gateway.stored_responses import StoredResponses


class StallTimeout(Protocol):
    """Of the gateway's config: how long an SSE frame may stay unread."""

    client_stall_timeout_s: float


class ResponseGateway(Protocol):
    """What these routes need of the gateway (``gateway/app.py:Gateway``)."""

    stored_responses: StoredResponses
    background: BackgroundRuns

    @property
    def config(self) -> StallTimeout: ...

    def tenant_of(self, request: Request) -> str: ...


async def read_previous(
    stored: StoredResponses,
    conversations: Conversations,
    body: ResponsesRequest,
    tenant: str,
) -> None:
    """Whether ``body``'s response is stored (``body._stored``; 400 for ``store: true`` where
    nothing is, and for ``background`` where it is not stored), the response its
    ``previous_response_id`` names (``body._previous``; 404 naming it when ``tenant`` has none
    such, 400 while it is a background response still running on a gateway that lives) and
    the conversation its ``conversation`` names (``body._conversation``; 404 naming it; 400
    beside a ``previous_response_id``)."""
    body._stored = stored.stores(body.store)
    if body.background and not body._stored:
        raise invalid(
            "a background response is stored: send store: true (or leave it out), to a "
            "gateway with a response store",
            "background",
        )
    if body.previous_response_id is not None:
        previous = await stored.get(body.previous_response_id, tenant, "previous_response_id")
        if previous.running and not stale(previous):
            raise invalid(
                f"response {body.previous_response_id!r} is still running in the background: "
                "continue it once it has ended",
                "previous_response_id",
            )
        body._previous = previous
    if body.conversation is not None:
        if body.previous_response_id is not None:
            raise invalid(
                "send either conversation or previous_response_id: a conversation holds the "
                "turns before",
                "conversation",
            )
        body._conversation = await conversations.get(
            _conversation_id(body.conversation), tenant, "conversation"
        )


def _conversation_id(given: str | dict[str, Any]) -> str:
    """``conversation`` as sent: its id, or an object with it."""
    if isinstance(given, str):
        return given
    if isinstance(given.get("id"), str):
        return given["id"]
    raise invalid("conversation is an id, or an object with its id", "conversation")


def conversation_session(body: ResponsesRequest, asked: str, response_id: str) -> str:
    """The session ``body``'s request goes to: the ``x-session-id`` ``asked``, else its
    previous response's, else its conversation's id, else its own id where it is stored (its
    follow-ups will name it), else none."""
    if asked:
        return asked
    if body._previous is not None:
        return body._previous.session_id
    if body._conversation is not None:
        return body._conversation.conversation_id
    return response_id if body._stored else ""


async def run_in_background(
    runs: BackgroundRuns,
    turn: ResponseTurn,
    open_events: Callable[[], AsyncGenerator[tuple[int, Chunk | Finish], None]],
    choices: Choices,
    metrics: RequestMetrics,
    span: Span,
    request_id: str,
    stall_timeout_s: float,
) -> Response:
    """Start ``turn``'s response in the background (``gateway/background.py``) and answer
    its POST: the response ``queued``, or with ``stream`` its events as they come."""
    stream = bool(turn.body.stream)
    run = await runs.start(turn, open_events, choices, metrics, stream, span)
    headers = {"x-request-id": header_value(request_id)}
    if not stream:
        return JSONResponse(run.snapshot(), headers=headers)
    return EventStreamResponse(_frames(run.follow(-1)), headers, stall_timeout_s)


async def _frames(batches: AsyncIterator[list[dict[str, Any]]]) -> AsyncIterator[bytes]:
    """Each batch of events as SSE frames in one write."""
    async for batch in batches:
        yield b"".join(TYPED_FRAMING.frame(event) for event in batch)


def add_response_routes(
    app: FastAPI,
    current: Callable[[], ResponseGateway],
    error_responses: dict[int | str, dict[str, Any]],
) -> None:
    """Add the four routes to ``app`` (``current``: the app's gateway, made on startup)."""

    @app.get(
        "/v1/responses/{response_id}", response_model=ResponseObject, responses=error_responses
    )
    async def retrieve_response(
        response_id: str,
        request: Request,
        include: Annotated[list[str] | None, Query()] = None,
        stream: bool = False,
        starting_after: Annotated[int | None, Query(ge=-1)] = None,
    ) -> Any:  # noqa: ANN401 (the response, or its stream)
        """A stored response, as it was answered; a background one as it is now, or with
        ``stream`` its events after ``starting_after``."""
        if any(name != LOGPROBS_INCLUDE for name in include or ()):
            raise invalid(f"of include, only {LOGPROBS_INCLUDE!r} is supported", "include")
        gateway = current()
        tenant = gateway.tenant_of(request)
        if stream:
            after = -1 if starting_after is None else starting_after
            batches = await gateway.background.follow(response_id, tenant, after)
            return EventStreamResponse(_frames(batches), {}, gateway.config.client_stall_timeout_s)
        if starting_after is not None:
            raise invalid("starting_after is for a stream (stream=true)", "starting_after")
        run = gateway.background.local(response_id, tenant)
        if run is not None:
            return run.snapshot()
        return answered(await gateway.stored_responses.get(response_id, tenant))

    @app.post(
        "/v1/responses/{response_id}/cancel",
        response_model=ResponseObject,
        responses=error_responses,
    )
    async def cancel_response(response_id: str, request: Request) -> dict[str, Any]:
        """Cancel a background response; the response once it has ended."""
        gateway = current()
        return await gateway.background.cancel(response_id, gateway.tenant_of(request))

    @app.delete(
        "/v1/responses/{response_id}", response_model=ResponseDeleted, responses=error_responses
    )
    async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
        """Forget a stored response (a follow-up naming it gets 404)."""
        gateway = current()
        await gateway.stored_responses.delete(response_id, gateway.tenant_of(request))
        return {"id": response_id, "object": "response", "deleted": True}

    @app.get(
        "/v1/responses/{response_id}/input_items",
        response_model=InputItemList,
        responses=error_responses,
    )
    async def list_input_items(
        response_id: str, request: Request, query: Annotated[PageQuery, Depends()]
    ) -> dict[str, Any]:
        """A stored response's input items, a page at a time."""
        gateway = current()
        found = await gateway.stored_responses.get(response_id, gateway.tenant_of(request))
        return asked_page(found.input_items, query)
