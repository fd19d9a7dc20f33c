"""The Responses API's stored responses over HTTP, and what a generation request of it does
with them (``gateway/stored_responses.py`` holds the contract):

- ``GET /v1/responses/{response_id}``: the stored response object (404 for an unknown,
  expired, deleted or another tenant's id); ``stream`` and ``include`` other than the
  logprobs one are 400s (background responses are not served; the object is as answered);
- ``DELETE /v1/responses/{response_id}``: ``{"id", "object": "response", "deleted": true}``;
- ``GET /v1/responses/{response_id}/input_items``: its input items a page at a time
  (``limit`` 1-100, default 20; ``order`` ``desc`` (default) or ``asc``; ``after`` an item
  id of the previous page; 400 naming ``after`` for an id not among them).

A ``POST /v1/responses`` reads the stored response its ``previous_response_id`` names before
its prompt is made (``read_previous``), goes to its conversation's session
(``conversation_session``) and is stored before its last event goes out (``storing``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal, Protocol

from fastapi import FastAPI, Query, Request

from splitserve.gateway.errors import invalid
from splitserve.gateway.responses_events import ResponsesBuilder
from splitserve.gateway.responses_input import LOGPROBS_INCLUDE
from splitserve.gateway.responses_schemas import (
    InputItemList,
    ResponseDeleted,
    ResponseObject,
    ResponsesRequest,
)
from splitserve.gateway.stored_responses import (
    StoredResponse,
    StoredResponses,
    conversation,
    input_items,
)


class ResponseGateway(Protocol):
    """What these routes need of the gateway (``gateway/app.py:Gateway``)."""

    stored_responses: StoredResponses

    def tenant_of(self, request: Request) -> str: ...


async def read_previous(stored: StoredResponses, body: ResponsesRequest, tenant: str) -> None:
    """Whether ``body``'s response is stored (``body._stored``; 400 for ``store: true`` where
    nothing is) and the response its ``previous_response_id`` names (``body._previous``; 404
    naming it when ``tenant`` has none such)."""
    body._stored = stored.stores(body.store)
    if body.previous_response_id is not None:
        body._previous = await stored.get(body.previous_response_id, tenant, "previous_response_id")


def conversation_session(body: ResponsesRequest, asked: str, response_id: str) -> str:
    """The session ``body``'s request goes to: the ``x-session-id`` ``asked``, else its
    previous response's, else its own id where it is stored (its follow-ups will name it),
    else none."""
    if asked:
        return asked
    if body._previous is not None:
        return body._previous.session_id
    return response_id if body._stored else ""


def storing(
    stored: StoredResponses,
    body: ResponsesRequest,
    builder: ResponsesBuilder,
    tenant: str,
    session_id: str,
) -> Callable[[], Awaitable[None]] | None:
    """What stores ``builder``'s response once it has ended (None where it is not stored)."""
    if not body._stored:
        return None
    earlier = [] if body._previous is None else conversation(body._previous)
    items = earlier + input_items(body.input)

    async def store() -> None:
        await stored.put(StoredResponse(builder.whole(), items, tenant, session_id))

    return store


def add_response_routes(
    app: FastAPI,
    current: Callable[[], ResponseGateway],
    error_responses: dict[int | str, dict[str, Any]],
) -> None:
    """Add the three routes to ``app`` (``current``: the app's gateway, made on startup)."""

    @app.get(
        "/v1/responses/{response_id}", response_model=ResponseObject, responses=error_responses
    )
    async def retrieve_response(
        response_id: str,
        request: Request,
        include: Annotated[list[str] | None, Query()] = None,
        stream: bool = False,
    ) -> dict[str, Any]:
        """A stored response, as it was answered."""
        if stream:
            raise invalid("a stored response is returned whole (no background runs)", "stream")
        if any(name != LOGPROBS_INCLUDE for name in include or ()):
            raise invalid(f"of include, only {LOGPROBS_INCLUDE!r} is supported", "include")
        gateway = current()
        found = await gateway.stored_responses.get(response_id, gateway.tenant_of(request))
        return found.response

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
        response_id: str,
        request: Request,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
        include: Annotated[list[str] | None, Query()] = None,
    ) -> dict[str, Any]:
        """A stored response's input items, a page at a time."""
        if include:
            raise invalid("no include is served for input items", "include")
        gateway = current()
        found = await gateway.stored_responses.get(response_id, gateway.tenant_of(request))
        items = found.input_items if order == "asc" else found.input_items[::-1]
        start = 0
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise invalid(f"no input item {after!r} in this response", "after")
            start = ids.index(after) + 1
        page = items[start : start + limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": start + limit < len(items),
        }
