"""What a Responses API request keeps once its response ended: the stored response
(``gateway/stored_responses.py``) and, where it names a ``conversation``, the turn added to
it (``gateway/conversations.py``).

Contract of ``ResponseTurn``:
- ``record()``: the response's record as it is when called: the response (or the one
  given), and its input
  items (those before it: a ``previous_response_id``'s conversation or the conversation's
  items, then its own input, each with an id made once per request);
- ``keep()``, awaited once the response ended (before its last event or its body goes out,
  ``gateway/reply.py:respond``'s ``finished``): the record put where it is stored, then
  ``add_to_conversation()``;
- ``add_to_conversation()``: the request's input items and the response's output items added
  to its conversation, where it names one and the response completed or was cut short
  (``incomplete``); a failed or cancelled response adds nothing;
- ``ending()``: ``keep``, or None where there is nothing to keep.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from splitserve.gateway.conversations import Conversations
from splitserve.gateway.responses_events import ResponsesBuilder
from splitserve.gateway.responses_schemas import ResponsesRequest
from splitserve.gateway.stored_responses import (
    StoredResponse,
    StoredResponses,
    conversation,
    input_items,
)

ADDED_STATUSES = ("completed", "incomplete")
"""The statuses of a response whose turn its conversation gets."""


@dataclass
class ResponseTurn:
    """One Responses request's response and what it keeps (module docstring)."""

    stored: StoredResponses
    conversations: Conversations
    body: ResponsesRequest
    builder: ResponsesBuilder
    tenant: str
    session_id: str
    new_items: list[dict[str, Any]] = field(init=False)
    """The request's input as items, each with its id."""

    def __post_init__(self) -> None:
        self.new_items = input_items(self.body.input)

    def _earlier(self) -> list[dict[str, Any]]:
        if self.body._previous is not None:
            return conversation(self.body._previous)
        if self.body._conversation is not None:
            return self.body._conversation.context()
        return []

    def record(self, response: dict[str, Any] | None = None) -> StoredResponse:
        """``response``: the response object to keep (None: the builder's as it is now)."""
        items = self._earlier() + self.new_items
        kept = self.builder.whole() if response is None else response
        return StoredResponse(kept, items, self.tenant, self.session_id)

    async def keep(self) -> None:
        if self.body._stored:
            await self.stored.put(self.record())
        await self.add_to_conversation()

    async def add_to_conversation(self) -> None:
        chosen = self.body._conversation
        if chosen is None or self.builder.status not in ADDED_STATUSES:
            return
        output = self.builder.whole()["output"]
        await self.conversations.add_turn(
            chosen.conversation_id, self.tenant, self.new_items + output
        )

    def ending(self) -> Callable[[], Awaitable[None]] | None:
        return self.keep if self.body._stored or self.body._conversation is not None else None
