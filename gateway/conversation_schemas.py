"""The Conversations API's bodies (``/v1/conversations``) as pydantic models: the requests,
and the responses for the OpenAPI schema (the routes answer plain dicts:
``gateway/conversation_routes.py``). Items are the Responses API's input items (messages,
``function_call`` and ``function_call_output`` items), checked as a response's input is."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from splitserve.gateway.conversations import MAX_ITEMS_ADDED


class ConversationCreate(BaseModel):
    """``POST /v1/conversations``."""

    model_config = ConfigDict(extra="forbid")
    items: list[dict[str, Any]] | None = Field(
        None, max_length=MAX_ITEMS_ADDED, description="Its first items (at most 20)."
    )
    metadata: dict[str, Any] | None = Field(
        None, description="At most 16 pairs of strings (keys up to 64 characters, values 512)."
    )


class ConversationUpdate(BaseModel):
    """``POST /v1/conversations/{conversation_id}``: its metadata replaced."""

    model_config = ConfigDict(extra="forbid")
    metadata: dict[str, Any]


class ItemsAdded(BaseModel):
    """``POST /v1/conversations/{conversation_id}/items``."""

    model_config = ConfigDict(extra="forbid")
    items: list[dict[str, Any]] = Field(..., min_length=1, max_length=MAX_ITEMS_ADDED)


class ConversationObject(BaseModel):
    id: str
    object: Literal["conversation"] = "conversation"
    created_at: int
    metadata: dict[str, str]


class ConversationDeleted(BaseModel):
    id: str
    object: Literal["conversation.deleted"] = "conversation.deleted"
    deleted: bool


class ConversationItemList(BaseModel):
    """A page of a conversation's items (or the items one call added)."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
