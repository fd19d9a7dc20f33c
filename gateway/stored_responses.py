"""The Responses API's stored responses: what a response keeps for ``previous_response_id``,
``GET``/``DELETE /v1/responses/{id}`` and its ``input_items``, over a ``ResponseStore``
(``common/response_store.py``: memory, a shared SQLite file, or etcd).

Contract:
- A response is stored unless its request says ``store: false`` (OpenAI's default) or the
  gateway runs with ``--response-store none`` (then ``store: true`` is a 400 naming it);
  stored once it ends (completed, incomplete or failed), before its last event or its body
  goes out, so a follow-up sent on seeing it finds it. It is kept ``--response-store-ttl``
  seconds.
- A stored record holds the response object as answered, its input items (the whole
  conversation up to it: a ``previous_response_id``'s items first, each with an id; the
  request's ``instructions`` are not among them, as OpenAI carries none over), the tenant
  whose key stored it (``common/api_keys.py:Caller``) and the conversation's session
  (``x-session-id``, else the first response's id: every turn goes to the decode worker holding
  its earlier turns' KV).
- A record is read only by its tenant: another tenant's id, an expired one and an unknown one
  alike are 404 naming the parameter (nothing says which).
- ``conversation(previous)``: the items a follow-up continues from, its input items then its
  output's messages and function calls (a reasoning model's reasoning is dropped, as chat
  templates drop earlier turns' reasoning).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Counter

from splitserve.common.response_store import ResponseStore, StoreFailed
from splitserve.gateway.defaults import STORED_RESPONSES_TTL_S
from splitserve.gateway.errors import ApiError, invalid

log = logging.getLogger(__name__)

_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


@dataclass(frozen=True)
class StoredResponse:
    """One stored response (module docstring). ``response`` and ``input_items`` are the
    API's JSON objects as the client sees them."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    tenant: str
    session_id: str
    events: list[dict[str, Any]] | None = None
    """A background response created with ``stream: true``: its events so far, for a stream
    resumed on another gateway (``gateway/background.py``); None otherwise."""
    updated_at: float = 0.0
    """When the record was put (seconds since the epoch): a background run's heartbeat."""

    def to_bytes(self) -> bytes:
        return orjson.dumps(
            {
                "response": self.response,
                "input_items": self.input_items,
                "tenant": self.tenant,
                "session_id": self.session_id,
                "events": self.events,
                "updated_at": self.updated_at,
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> StoredResponse:
        record = orjson.loads(data)
        return cls(
            record["response"],
            record["input_items"],
            record["tenant"],
            record["session_id"],
            record.get("events"),
            record.get("updated_at", 0.0),
        )

    @property
    def running(self) -> bool:
        """Whether it is a background response that has not ended (as last put)."""
        return self.response.get("status") in ("queued", "in_progress")


def not_found(response_id: str, param: str) -> ApiError:
    return ApiError(
        404,
        f"no stored response {response_id!r}: it was never stored (store: false), has "
        "expired or was deleted",
        param=param,
        code="not_found",
    )


def store_unavailable(error: StoreFailed) -> ApiError:
    return ApiError(
        503,
        f"the response store is unavailable: {error}",
        type="server_error",
        code="store_unavailable",
    )


class StoredResponses:
    """The gateway's stored responses over ``store`` (None: ``--response-store none``)."""

    def __init__(
        self,
        store: ResponseStore | None,
        ttl_s: float = STORED_RESPONSES_TTL_S,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.failed_puts = 0
        """Responses that were to be stored and were not (the backend refused: logged)."""
        self._failures = (
            None
            if registry is None
            else Counter(
                "splitserve_response_store_failures",
                "Responses that were to be stored and were not (the store refused them or "
                "could not be reached; gateway/stored_responses.py).",
                registry=registry,
            )
        )

    def stores(self, asked: bool | None) -> bool:
        """Whether a response whose request said ``store: asked`` is stored; 400 naming
        ``store`` for ``true`` where nothing is stored."""
        if self.store is None and asked:
            raise invalid(
                "responses are not stored by this gateway (--response-store none): send "
                "store: false, or the conversation as input",
                "store",
            )
        return self.store is not None and asked is not False

    async def get(
        self, response_id: str, tenant: str, param: str = "response_id"
    ) -> StoredResponse:
        """``tenant``'s stored response ``response_id``; 404 naming ``param`` otherwise, 503
        where the store cannot be read."""
        if self.store is None:
            raise invalid(
                "responses are not stored by this gateway (--response-store none): send the "
                "conversation as input",
                param,
            )
        try:
            data = await self.store.get(response_id)
        except StoreFailed as error:
            raise store_unavailable(error) from error
        stored = None if data is None else StoredResponse.from_bytes(data)
        if stored is None or stored.tenant != tenant:
            raise not_found(response_id, param)
        if stored.running:  # its gateway's latest sign of life may be newer than the record
            alive = await self._alive_at(response_id)
            if alive > stored.updated_at:
                stored = dataclasses.replace(stored, updated_at=alive)
        return stored

    async def put(self, stored: StoredResponse) -> int:
        """Keep ``stored``; a backend's refusal is logged and counted, never raised (the
        response was answered; a follow-up naming it gets the 404). Returns the record's
        size in bytes."""
        assert self.store is not None
        stamped = dataclasses.replace(stored, updated_at=time.time())
        data = stamped.to_bytes()
        try:
            await self.store.put(stored.response["id"], data, self.ttl_s)
        except StoreFailed as error:
            self.count_failed_put()
            log.warning("response %s was not stored: %s", stored.response["id"], error)
        return len(data)

    async def put_alive(self, response_id: str) -> None:
        """Put the sign of life of a running response whose record is put less often (a
        large background response's: ``gateway/background.py``); ``get`` reads it as the
        record's ``updated_at``. A refusal is logged: the next one may pass."""
        assert self.store is not None
        try:
            await self.store.put(_alive_key(response_id), repr(time.time()).encode(), self.ttl_s)
        except StoreFailed as error:
            log.warning("response %s: its sign of life was not put: %s", response_id, error)

    async def _alive_at(self, response_id: str) -> float:
        """When ``put_alive`` last put ``response_id``'s sign of life (0: never, or the store
        cannot say)."""
        assert self.store is not None
        try:
            data = await self.store.get(_alive_key(response_id))
        except StoreFailed:
            return 0.0
        try:
            return 0.0 if data is None else float(data)
        except ValueError:
            return 0.0

    def count_failed_put(self) -> None:
        """Count something that was to be kept and was not (logged by the caller)."""
        self.failed_puts += 1
        if self._failures is not None:
            self._failures.inc()

    async def delete(self, response_id: str, tenant: str) -> None:
        """Delete ``tenant``'s ``response_id``; 404 as ``get``."""
        await self.get(response_id, tenant)
        assert self.store is not None
        try:
            await self.store.delete(response_id)
        except StoreFailed as error:
            raise store_unavailable(error) from error

    async def ask_cancel(self, response_id: str) -> None:
        """Put the mark that asks the gateway running ``response_id`` in the background to
        cancel it (``gateway/background.py``); 503 where the store cannot keep it."""
        assert self.store is not None
        try:
            await self.store.put(_cancel_key(response_id), b"1", self.ttl_s)
        except StoreFailed as error:
            raise store_unavailable(error) from error

    async def cancel_asked(self, response_id: str) -> bool:
        """Whether a cancel mark was put for ``response_id`` (False where the store cannot be
        read: the next look may see it)."""
        assert self.store is not None
        try:
            return await self.store.get(_cancel_key(response_id)) is not None
        except StoreFailed:
            return False

    async def close(self) -> None:
        if self.store is not None:
            await self.store.close()


def _cancel_key(response_id: str) -> str:
    return f"{response_id}.cancel"


def _alive_key(response_id: str) -> str:
    return f"{response_id}.alive"


def input_items(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's ``input`` as the items ``input_items`` lists: text as one user message,
    every item with an id (its own, or a new one), message content as parts."""
    if isinstance(given, str):
        given = [{"type": "message", "role": "user", "content": given}]
    items = []
    for item in given:
        item = dict(item)
        kind = item.setdefault("type", "message")
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        if not item.get("id"):
            item["id"] = f"{_ITEM_PREFIX.get(kind, 'item')}_{uuid.uuid4().hex}"
        items.append(item)
    return items


def conversation(previous: StoredResponse) -> list[dict[str, Any]]:
    """The items a follow-up of ``previous`` continues from (module docstring)."""
    output = [item for item in previous.response["output"] if item["type"] != "reasoning"]
    return previous.input_items + output
