"""Client chunks -> the Responses API's response object and its stream of typed events.

``ResponsesBuilder`` folds a request's chunks through a ``ChatBuilder`` (so text and tool
calls are told apart exactly as chat completions tell them: a possible call is held back until
it is known, ``gateway/responses.py``) and turns each chat delta into Responses events.

Contract of a stream (each event has ``type`` and a ``sequence_number`` counting from 0):
- ``response.created`` and ``response.in_progress`` (the response, ``status: in_progress``);
- text: ``response.output_item.added`` (a ``message`` item), ``response.content_part.added``
  (an ``output_text`` part), one ``response.output_text.delta`` per piece of text, and at the
  end ``response.output_text.done``, ``response.content_part.done`` and
  ``response.output_item.done`` with the whole text;
- a reasoning model's reasoning (``--reasoning-parser``: ``client/reasoning.py``), first:
  ``response.output_item.added`` (a ``reasoning`` item), one
  ``response.reasoning_text.delta`` per piece, and at the end
  ``response.reasoning_text.done`` and ``response.output_item.done``; the usage's
  ``reasoning_tokens`` counts the tokens of the chunks that carried reasoning;
- each tool call: ``response.output_item.added`` (a ``function_call`` item with its
  ``call_id`` and name), ``response.function_call_arguments.delta`` per piece of its
  arguments, and at the end ``response.function_call_arguments.done`` and
  ``response.output_item.done``;
- last, ``response.completed`` (finished by a stop or a call), ``response.incomplete``
  (``max_output_tokens`` reached: ``incomplete_details.reason``) or ``response.failed``
  (cancelled), each with the whole response and its ``usage``;
- a failure after the stream began ends it with an ``error`` event.
The non-streamed response is the object the last event carries. A response has at least one
output item: an answer of no text is a message with empty text.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from splitserve.client import Chunk, Finish, Usage
from splitserve.client.tools import ToolPlan
from splitserve.gateway.errors import ApiError
from splitserve.gateway.responses import ChatBuilder, ResponseBuilder
from splitserve.gateway.responses_input import wants_logprobs
from splitserve.gateway.responses_schemas import ResponsesRequest

_FINAL = {"stop": "completed", "tool_calls": "completed", "length": "incomplete"}
"""Chat's finish reason -> the response's status ("cancelled" otherwise)."""
_FINAL_EVENT = {"completed": "response.completed", "incomplete": "response.incomplete"}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesBuilder(ResponseBuilder):
    """One request's response object and events (module docstring)."""

    object_name = chunk_object_name = "response"

    def __init__(
        self, response_id: str, model: str, body: ResponsesRequest, tools: ToolPlan | None
    ) -> None:
        super().__init__(response_id, model)
        self.body = body
        self.want_logprobs = wants_logprobs(body)
        self.chat = ChatBuilder(
            response_id, model, self.want_logprobs, 0, tools, reasoning=body._reasoning_format
        )
        self.sequence = 0
        self.status = "in_progress"
        self.error: dict[str, Any] | None = None
        """The response's ``error`` once it failed or was cancelled."""
        self.completed_at: int | None = None
        self.output: list[dict[str, Any]] = []
        """Output items in order, as the stream has them so far."""
        self.message: dict[str, Any] | None = None
        """The message item text goes to (None until text arrives)."""
        self.reasoning: dict[str, Any] | None = None
        """The reasoning item (None until reasoning arrives)."""
        self.reasoning_tokens = 0
        self.calls: list[dict[str, Any]] = []
        """Function call items by the chat stream's call index."""
        self.index_of: dict[str, int] = {}
        """Each output item's index in ``output``, by its id."""

    # ---- events ---------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def opening_chunks(self) -> list[dict[str, Any]]:
        snapshot = self.whole()  # both events carry the response as it starts
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def queued_events(self) -> list[dict[str, Any]]:
        """A background response's opening (``gateway/background.py``), before it runs:
        ``response.created`` and ``response.queued``, the response ``queued``."""
        snapshot = {**self.whole(), "status": "queued"}
        return [
            self._event("response.created", response=snapshot),
            self._event("response.queued", response=snapshot),
        ]

    def in_progress_events(self) -> list[dict[str, Any]]:
        """A background response's ``response.in_progress``, once it runs."""
        return [self._event("response.in_progress", response=self.whole())]

    def add(self, chunk: Chunk) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        reasoned = False
        for chat_chunk in self.chat.add(chunk):
            choice = chat_chunk["choices"][0]
            reasoned = reasoned or bool(choice["delta"].get("reasoning_content"))
            events += self._from_choice(choice)
        self.reasoning_tokens += len(chunk.token_ids) if reasoned else 0
        self.usage = chunk.usage
        return events

    def finish(self, end: Finish) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for chat_chunk in self.chat.finish(end):
            events += self._from_choice(chat_chunk["choices"][0])
        self.usage = end.usage
        self.status = _FINAL.get(self.chat.finish_reason or "", "cancelled")
        if self.status == "cancelled":
            self.error = {"code": "cancelled", "message": "the request was cancelled"}
        if not self.output:
            events += self._open_message()
        item_status = "completed" if self.status == "completed" else "incomplete"
        for index, item in enumerate(self.output):
            events += self._close(index, item, item_status)
        self.completed_at = int(time.time())
        final = _FINAL_EVENT.get(self.status, "response.failed")
        events.append(self._event(final, response=self.whole()))
        return events

    def error_events(self, error: ApiError) -> list[dict[str, Any]]:
        """An ``error`` event; its ``code`` the error's, else its type."""
        code = error.code or error.type
        return [self._event("error", code=code, message=error.message, param=error.param)]

    def fail(self, error: ApiError) -> list[dict[str, Any]]:
        """End the response ``failed`` with ``error`` (a background run's failure, which no
        HTTP status can carry: ``gateway/background.py``): the ``error`` event, then
        ``response.failed`` with the response, its ``error`` the same."""
        events = self.error_events(error)
        self.status = "failed"
        self.error = {"code": error.code or error.type, "message": error.message}
        for index, item in enumerate(self.output):
            if item["status"] == "in_progress":
                events += self._close(index, item, "incomplete")
        self.completed_at = int(time.time())
        events.append(self._event("response.failed", response=self.whole()))
        return events

    def _from_choice(self, choice: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat chunk's choice: its text, its tool call pieces."""
        events: list[dict[str, Any]] = []
        delta = choice["delta"]
        if thought := delta.get("reasoning_content"):
            events += self._reasoning_piece(thought)
        text = delta.get("content") or ""
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        if text or logprobs:  # a token of no text (the stop token) may still have a logprob
            if self.message is None:
                events += self._open_message()
            assert self.message is not None
            part = self.message["content"][0]
            part["text"] += text
            if self.want_logprobs:
                part["logprobs"] += logprobs
            delta_event = "response.output_text.delta"
            events.append(
                self._part_event(delta_event, self.message, delta=text, logprobs=logprobs)
            )
        for entry in delta.get("tool_calls") or ():
            events += self._call_piece(entry)
        return events

    def _reasoning_piece(self, thought: str) -> list[dict[str, Any]]:
        """A piece of the reasoning: the reasoning item opened at the first."""
        events = []
        if self.reasoning is None:
            self.reasoning = {
                "type": "reasoning",
                "id": _item_id("rs"),
                "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}],
                "status": "in_progress",
            }
            index = self._append(self.reasoning)
            events.append(
                self._event(
                    "response.output_item.added", output_index=index, item=_copy(self.reasoning)
                )
            )
        self.reasoning["content"][0]["text"] += thought
        events.append(
            self._part_event("response.reasoning_text.delta", self.reasoning, delta=thought)
        )
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": []}
        if self.want_logprobs:
            part["logprobs"] = []
        self.message = {
            "type": "message",
            "id": _item_id("msg"),
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        index = self._append(self.message)
        added = self._event(
            "response.output_item.added", output_index=index, item=_copy(self.message)
        )
        self.message["content"].append(part)
        return [
            added,
            self._part_event("response.content_part.added", self.message, part=_copy_part(part)),
        ]

    def _append(self, item: dict[str, Any]) -> int:
        """Add an output item; its index."""
        self.index_of[item["id"]] = len(self.output)
        self.output.append(item)
        return len(self.output) - 1

    def _call_piece(self, entry: dict[str, Any]) -> list[dict[str, Any]]:
        """A chat ``delta.tool_calls`` entry: a new call's item, or the next piece of a
        call's arguments."""
        function = entry.get("function") or {}
        events = []
        if "id" in entry:
            item = {
                "type": "function_call",
                "id": _item_id("fc"),
                "call_id": entry["id"],
                "name": function.get("name", ""),
                "arguments": "",
                "status": "in_progress",
            }
            self.calls.append(item)
            index = self._append(item)
            events.append(
                self._event("response.output_item.added", output_index=index, item=dict(item))
            )
        item = self.calls[entry["index"]]
        if pieces := function.get("arguments"):
            item["arguments"] += pieces
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self.index_of[item["id"]],
                    delta=pieces,
                )
            )
        return events

    def _part_event(self, kind: str, item: dict[str, Any], **fields: Any) -> dict[str, Any]:
        """An event about message ``item``'s one content part."""
        return self._event(kind, item_id=item["id"], output_index=self.index_of[item["id"]],
                           content_index=0, **fields)  # fmt: skip

    def _close(self, index: int, item: dict[str, Any], status: str) -> list[dict[str, Any]]:
        """The events that end output item ``index``, now with its final ``status``."""
        item["status"] = status
        events = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events.append(self._part_event("response.reasoning_text.done", item, text=text))
        elif item["type"] == "message":
            part = item["content"][0]
            events.append(
                self._part_event(
                    "response.output_text.done",
                    item,
                    text=part["text"],
                    logprobs=list(part.get("logprobs", ())),
                )
            )
            events.append(
                self._part_event("response.content_part.done", item, part=_copy_part(part))
            )
        else:
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )
            )
        events.append(
            self._event("response.output_item.done", output_index=index, item=_copy(item))
        )
        return events

    # ---- the object -----------------------------------------------------------------------

    def whole(self) -> dict[str, Any]:
        body = self.body
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created,
            "status": self.status,
            "completed_at": self.completed_at,
            "error": self.error,
            "incomplete_details": {"reason": "max_output_tokens"}
            if self.status == "incomplete"
            else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens or body.max_tokens,
            "model": self.model,
            "output": [_copy(item) for item in self.output],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "background": bool(body.background),
            "metadata": body.metadata or {},
            "store": body._stored,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
            "tools": body.tools or [],
            "truncation": "disabled",
            "usage": None
            if self.usage is None or self.status == "in_progress"
            else _usage(self.usage, self.reasoning_tokens),
        }


def _usage(usage: Usage, reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """An item as it is now (its content parts copied: the builder goes on adding to them)."""
    copied = dict(item)
    if "content" in copied:
        copied["content"] = [_copy_part(part) for part in copied["content"]]
    return copied


def _copy_part(part: dict[str, Any]) -> dict[str, Any]:
    copied = dict(part)
    if "logprobs" in copied:
        copied["logprobs"] = list(copied["logprobs"])
    return copied
