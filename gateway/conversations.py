"""The Conversations API's conversations: items in order and metadata, kept in the gateway's
response store (``common/response_store.py``) beside its stored responses, so every gateway
sharing the store serves them.

Contract:
- A conversation has an id (``conv_<hex>``), ``created_at``, ``metadata``
  (``gateway/metadata.py``) and its items in order, each
  with an id (``gateway/stored_responses.py:input_items`` gives those that lack one). It
  belongs to the tenant whose key made it (``common/api_keys.py``): any other tenant's ask,
  an unknown, expired or deleted id alike, is a 404 naming the parameter.
- It is kept ``--response-store-ttl`` seconds after its last change (each change puts it
  again).
- Every change (items added or deleted, metadata replaced, a response's turn) reads it,
  changes it and writes it only over what it read (``ResponseStore.replace``), again from
  the read where another write came between: changes made at once on several gateways are
  all kept.
- ``context()``: what a response naming the conversation continues from: its items, less
  reasoning items (as chat templates drop earlier turns' reasoning).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import orjson

from splitserve.common.response_store import ResponseStore, StoreFailed
from splitserve.gateway.errors import ApiError, invalid
from splitserve.gateway.stored_responses import StoredResponses, store_unavailable

log = logging.getLogger(__name__)

MAX_ITEMS_ADDED = 20
"""Items one create or add call takes (OpenAI's limit)."""
MAX_ATTEMPTS = 64
"""Reads and writes of one change before it gives up on a store that keeps moving under it."""


@dataclass(frozen=True)
class StoredConversation:
    """One conversation (module docstring); ``items`` are the API's JSON items."""

    conversation_id: str
    created_at: int
    metadata: dict[str, str]
    items: list[dict[str, Any]]
    tenant: str

    def to_bytes(self) -> bytes:
        return orjson.dumps(
            {
                "id": self.conversation_id,
                "created_at": self.created_at,
                "metadata": self.metadata,
                "items": self.items,
                "tenant": self.tenant,
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> StoredConversation:
        record = orjson.loads(data)
        return cls(
            record["id"], record["created_at"], record["metadata"], record["items"],
            record["tenant"],
        )  # fmt: skip

    def object(self) -> dict[str, Any]:
        """The API's conversation object."""
        return {
            "id": self.conversation_id,
            "object": "conversation",
            "created_at": self.created_at,
            "metadata": self.metadata,
        }

    def context(self) -> list[dict[str, Any]]:
        """The items a response naming it continues from (module docstring)."""
        return [item for item in self.items if item.get("type") != "reasoning"]


def not_found(conversation_id: str, param: str) -> ApiError:
    return ApiError(
        404,
        f"no conversation {conversation_id!r}: it was never made, has expired or was deleted",
        param=param,
        code="not_found",
    )


class Conversations:
    """The gateway's conversations, in ``stored``'s store for its time to live."""

    def __init__(self, stored: StoredResponses) -> None:
        self.stored = stored

    def _store(self, param: str) -> ResponseStore:
        if self.stored.store is None:
            raise invalid(
                "conversations are kept in the response store, and this gateway has none "
                "(--response-store none)",
                param,
            )
        return self.stored.store

    async def create(
        self, tenant: str, items: list[dict[str, Any]], metadata: dict[str, str]
    ) -> StoredConversation:
        conversation = StoredConversation(
            f"conv_{uuid.uuid4().hex}", int(time.time()), metadata, items, tenant
        )
        try:
            await self._store("items").put(
                conversation.conversation_id, conversation.to_bytes(), self.stored.ttl_s
            )
        except StoreFailed as error:
            raise store_unavailable(error) from error
        return conversation

    async def get(
        self, conversation_id: str, tenant: str, param: str = "conversation_id"
    ) -> StoredConversation:
        """``tenant``'s conversation; 404 naming ``param`` otherwise, 503 where the store
        cannot be read."""
        return (await self._read(conversation_id, tenant, param))[0]

    async def _read(
        self, conversation_id: str, tenant: str, param: str
    ) -> tuple[StoredConversation, bytes]:
        """The conversation and the bytes it was read as."""
        if not conversation_id.startswith("conv_"):
            raise not_found(conversation_id, param)
        try:
            data = await self._store(param).get(conversation_id)
        except StoreFailed as error:
            raise store_unavailable(error) from error
        found = None if data is None else StoredConversation.from_bytes(data)
        if found is None or found.tenant != tenant:
            raise not_found(conversation_id, param)
        assert data is not None
        return found, data

    async def change(
        self,
        conversation_id: str,
        tenant: str,
        how: Callable[[StoredConversation], StoredConversation],
        param: str = "conversation_id",
    ) -> StoredConversation:
        """The conversation changed ``how`` (which may raise ``ApiError`` to refuse), written
        over what was read, again where another write came between (module docstring)."""
        store = self._store(param)
        for _ in range(MAX_ATTEMPTS):
            found, data = await self._read(conversation_id, tenant, param)
            changed = how(found)
            try:
                if await store.replace(
                    conversation_id, changed.to_bytes(), self.stored.ttl_s, data
                ):
                    return changed
            except StoreFailed as error:
                raise store_unavailable(error) from error
        raise ApiError(
            409,
            f"conversation {conversation_id!r} kept changing under this change: send it again",
            param=param,
            code="conflict",
        )

    async def delete(self, conversation_id: str, tenant: str) -> None:
        await self.get(conversation_id, tenant)
        try:
            await self._store("conversation_id").delete(conversation_id)
        except StoreFailed as error:
            raise store_unavailable(error) from error

    async def add_turn(
        self, conversation_id: str, tenant: str, items: list[dict[str, Any]]
    ) -> None:
        """Add a response's input and output items once it ended; a failure is logged and
        counted as a response the store did not keep (the response was answered)."""
        try:
            await self.change(
                conversation_id, tenant, lambda found: replace(found, items=found.items + items)
            )
        except ApiError as error:
            self.stored.count_failed_put()
            log.warning("a turn of %s was not kept: %s", conversation_id, error.message)
