"""The Conversations API over HTTP, as OpenAI's (``gateway/conversations.py`` holds the
contract; the openai SDK's ``conversations`` and ``conversations.items`` call these):

- ``POST /v1/conversations`` (``items``, ``metadata``): the conversation object;
- ``GET``, ``POST`` (new ``metadata``), ``DELETE /v1/conversations/{conversation_id}``;
- ``POST /v1/conversations/{conversation_id}/items`` (``items``, 1-20): the list of the items
  added, each with its id;
- ``GET /v1/conversations/{conversation_id}/items``: a page (``limit`` 1-100, default 20;
  ``order`` ``desc`` (default) or ``asc``; ``after`` an item id);
- ``GET``, ``DELETE /v1/conversations/{conversation_id}/items/{item_id}``: the item; the
  conversation once it is deleted.

Items are checked as a response's input items are (``gateway/responses_input.py:check_items``:
a 400 naming ``items.<i>...``); ``include`` is a 400 (no extras are served).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Annotated, Any, Protocol

from fastapi import Depends, FastAPI, Query, Request

from splitserve.gateway.conversation_schemas import (
    ConversationCreate,
    ConversationDeleted,
    ConversationItemList,
    ConversationObject,
    ConversationUpdate,
    ItemsAdded,
)
from splitserve.gateway.conversations import Conversations, StoredConversation
from splitserve.gateway.errors import ApiError
from splitserve.gateway.item_pages import PageQuery, asked_page, page, refuse_include
from splitserve.gateway.metadata import checked_metadata
from splitserve.gateway.responses_input import check_items
from splitserve.gateway.stored_responses import input_items


class ConversationGateway(Protocol):
    """What these routes need of the gateway (``gateway/app.py:Gateway``)."""

    conversations: Conversations

    def tenant_of(self, request: Request) -> str: ...


def _item(found: StoredConversation, item_id: str) -> dict[str, Any]:
    for item in found.items:
        if item["id"] == item_id:
            return item
    raise ApiError(404, f"no item {item_id!r} in this conversation", param="item_id",
                   code="not_found")  # fmt: skip


def _without(item_id: str) -> Callable[[StoredConversation], StoredConversation]:
    def how(found: StoredConversation) -> StoredConversation:
        _item(found, item_id)  # 404 where it is not there
        kept = [item for item in found.items if item["id"] != item_id]
        return dataclasses.replace(found, items=kept)

    return how


def add_conversation_routes(
    app: FastAPI,
    current: Callable[[], ConversationGateway],
    error_responses: dict[int | str, dict[str, Any]],
) -> None:
    """Add the routes to ``app`` (``current``: the app's gateway, made on startup)."""
    one = "/v1/conversations/{conversation_id}"

    @app.post("/v1/conversations", response_model=ConversationObject, responses=error_responses)
    async def create_conversation(body: ConversationCreate, request: Request) -> dict[str, Any]:
        """A new conversation, with its first items."""
        items = body.items or []
        check_items(items, "items")
        gateway = current()
        made = await gateway.conversations.create(
            gateway.tenant_of(request), input_items(items), checked_metadata(body.metadata)
        )
        return made.object()

    @app.get(one, response_model=ConversationObject, responses=error_responses)
    async def get_conversation(conversation_id: str, request: Request) -> dict[str, Any]:
        gateway = current()
        found = await gateway.conversations.get(conversation_id, gateway.tenant_of(request))
        return found.object()

    @app.post(one, response_model=ConversationObject, responses=error_responses)
    async def update_conversation(
        conversation_id: str, body: ConversationUpdate, request: Request
    ) -> dict[str, Any]:
        """Its metadata replaced."""
        metadata = checked_metadata(body.metadata)
        gateway = current()
        changed = await gateway.conversations.change(
            conversation_id,
            gateway.tenant_of(request),
            lambda found: dataclasses.replace(found, metadata=metadata),
        )
        return changed.object()

    @app.delete(one, response_model=ConversationDeleted, responses=error_responses)
    async def delete_conversation(conversation_id: str, request: Request) -> dict[str, Any]:
        gateway = current()
        await gateway.conversations.delete(conversation_id, gateway.tenant_of(request))
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    @app.post(f"{one}/items", response_model=ConversationItemList, responses=error_responses)
    async def add_items(
        conversation_id: str,
        body: ItemsAdded,
        request: Request,
        include: Annotated[list[str] | None, Query()] = None,
    ) -> dict[str, Any]:
        """Items added at its end; the list of them as added."""
        refuse_include(include)
        check_items(body.items, "items")
        added = input_items(body.items)
        gateway = current()
        await gateway.conversations.change(
            conversation_id,
            gateway.tenant_of(request),
            lambda found: dataclasses.replace(found, items=found.items + added),
        )
        return page(added, len(added))

    @app.get(f"{one}/items", response_model=ConversationItemList, responses=error_responses)
    async def list_items(
        conversation_id: str, request: Request, query: Annotated[PageQuery, Depends()]
    ) -> dict[str, Any]:
        gateway = current()
        found = await gateway.conversations.get(conversation_id, gateway.tenant_of(request))
        return asked_page(found.items, query)

    @app.get(f"{one}/items/{{item_id}}", responses=error_responses)
    async def get_item(
        conversation_id: str,
        item_id: str,
        request: Request,
        include: Annotated[list[str] | None, Query()] = None,
    ) -> dict[str, Any]:
        refuse_include(include)
        gateway = current()
        found = await gateway.conversations.get(conversation_id, gateway.tenant_of(request))
        return _item(found, item_id)

    @app.delete(
        f"{one}/items/{{item_id}}", response_model=ConversationObject, responses=error_responses
    )
    async def delete_item(conversation_id: str, item_id: str, request: Request) -> dict[str, Any]:
        """The item dropped; the conversation."""
        gateway = current()
        changed = await gateway.conversations.change(
            conversation_id, gateway.tenant_of(request), _without(item_id)
        )
        return changed.object()
