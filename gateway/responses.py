"""Client chunks -> OpenAI response dicts (completions and chat; whole and streamed).

Plain dicts on purpose: this runs for every streamed token, and ``json.dumps`` of a dict is
several times cheaper than validating a pydantic model. ``gateway/schemas.py`` describes the
same shapes for the OpenAPI schema; tests validate these dicts against those models.

Each builder is per request: it accumulates text, logprobs and usage as chunks arrive, so a
non-streamed response is the fold of the streamed chunks. ``ResponseBuilder`` is what the one
generation handler (``gateway/app.py``) needs of each endpoint's shape (the Responses API's:
``gateway/responses_events.py``).
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass
from typing import Any

from splitserve.client import Chunk, Finish, PromptToken, TokenLogprob, Usage
from splitserve.client.hermes_tools import TaggedStream
from splitserve.client.reasoning import ReasoningStream
from splitserve.client.tools import ToolPlan
from splitserve.gateway.errors import ApiError
from splitserve.gateway.tools import ToolCallDeltas


def usage_dict(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def _empty_completion_logprobs() -> dict[str, list[Any]]:
    """The legacy completions logprobs object, with no tokens yet."""
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def prompt_logprobs_dict(chunk: Chunk) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs`` of a chunk carrying them: null for the first prompt token,
    then per prompt token its own entry and its top alternatives, by token id (a string)."""
    positions: list[dict[str, Any] | None] = [None]
    for entry in chunk.prompt_logprobs:
        position = {
            str(entry.token_id): {
                "logprob": entry.logprob, "rank": entry.rank, "decoded_token": entry.text,
            }
        }  # fmt: skip
        for rank, top in enumerate(entry.top, start=1):
            position.setdefault(
                str(top.token_id),
                {"logprob": top.logprob, "rank": rank, "decoded_token": top.text},
            )
        positions.append(position)
    return positions


def _legacy_logprobs(
    entries: tuple[TokenLogprob, ...], offset: int, top: int | None = None
) -> dict[str, list[Any]]:
    """``entries`` in the legacy completions logprobs shape, their text offsets counted from
    ``offset``, each with its first ``top`` alternatives (None: all it has)."""
    out = _empty_completion_logprobs()
    for entry in entries:
        out["tokens"].append(entry.text)
        out["token_logprobs"].append(entry.logprob)
        out["top_logprobs"].append({alt.text: alt.logprob for alt in entry.top[:top]})
        out["text_offset"].append(offset)
        offset += len(entry.text)
    return out


def _echo_logprobs(
    first: PromptToken | None, prompt: tuple[TokenLogprob, ...], top: int
) -> dict[str, list[Any]]:
    """The prompt's tokens in the legacy completions logprobs shape (``echo`` with
    ``logprobs``): the first with null logprob and alternatives, then each with its own and
    its ``top`` alternatives; offsets into the echoed prompt from 0."""
    if first is None:
        return _empty_completion_logprobs()
    out = _legacy_logprobs(prompt, len(first.text), top)
    for key, value in (("tokens", first.text), ("token_logprobs", None),
                       ("top_logprobs", None), ("text_offset", 0)):  # fmt: skip
        out[key].insert(0, value)
    return out


@dataclass(frozen=True)
class Extras:
    """What a choice shows beside its text and logprobs, as its request asked (vLLM's
    fields)."""

    prompt_logprobs: bool = False
    """``prompt_logprobs``: the prompt's, in vLLM's form (whole responses only)."""
    prompt_token_ids: tuple[int, ...] | None = None
    """``return_token_ids``: the prompt's ids (shown once: in the whole response, on the
    stream's first event), and each choice's generated ids (``token_ids``: in the whole
    response all of them; streamed, each event those since the last, so that they join to
    the whole's). None: not asked."""


NO_EXTRAS = Extras()


@dataclass(frozen=True)
class PromptShown:
    """What a response may show of one prompt, fetched once per prompt where its request asks
    (``gateway/app.py``): its text (``echo``) and its token ids (``return_token_ids``)."""

    echo_text: str = ""
    token_ids: tuple[int, ...] | None = None


class ResponseBuilder(abc.ABC):
    """One request's response in one endpoint's shape. Streamed: ``opening_chunks``, then
    ``add`` for each chunk and ``finish`` for the end (each folds the item in and returns the
    events that stream it, in order; none while it holds the item back), then ``usage_chunk``
    if asked; a failure after events were sent ends the stream with ``error_events``; not
    streamed: ``whole`` after the same ``add`` and ``finish`` calls."""

    object_name: str
    chunk_object_name: str

    def __init__(
        self, response_id: str, model: str, index: int = 0, extras: Extras = NO_EXTRAS
    ) -> None:
        self.response_id = response_id
        self.model = model
        self.index = index
        """The choice this builder answers (several share one response: ``gateway/choices.py``)."""
        self.created = int(time.time())
        self.usage: Usage | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.extras = extras
        self._has_extras = extras != NO_EXTRAS
        """Whether any extra is asked (most requests: none, and nothing here runs per token)."""
        self.prompt_logprobs: list[dict[str, Any] | None] | None = None
        self.token_ids: list[int] = []
        self._unsent_token_ids: list[int] = []
        self._prompt_ids_sent = False

    def _fold_extras(self, chunk: Chunk) -> None:
        """Keep what ``extras`` shows of ``chunk``."""
        if not self._has_extras:
            return
        if chunk.prompt_logprobs and self.extras.prompt_logprobs:
            self.prompt_logprobs = prompt_logprobs_dict(chunk)
        if self.extras.prompt_token_ids is not None:
            self.token_ids += chunk.token_ids
            self._unsent_token_ids += chunk.token_ids

    def _send_token_ids(self, where: dict[str, Any], choice: dict[str, Any]) -> None:
        """With ``return_token_ids``, an event's ids: the prompt's in ``where`` (the choice,
        or for chat the event) on the stream's first event, the ids since the last event in
        ``choice``."""
        if not self._has_extras or self.extras.prompt_token_ids is None:
            return
        if not self._prompt_ids_sent:
            where["prompt_token_ids"] = list(self.extras.prompt_token_ids)
            self._prompt_ids_sent = True
        choice["token_ids"], self._unsent_token_ids = self._unsent_token_ids, []

    def _whole_extras(self, where: dict[str, Any], choice: dict[str, Any]) -> None:
        """The whole response's extras: the prompt's logprobs and ids in ``where``, the
        generated ids in ``choice``."""
        if self.extras.prompt_logprobs:
            where["prompt_logprobs"] = self.prompt_logprobs
        if self.extras.prompt_token_ids is not None:
            where["prompt_token_ids"] = list(self.extras.prompt_token_ids)
            choice["token_ids"] = list(self.token_ids)

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def opening_chunks(self) -> list[dict[str, Any]]:
        """What a stream sends before its first item (nothing, unless the shape wants it)."""
        return []

    @abc.abstractmethod
    def add(self, chunk: Chunk) -> list[dict[str, Any]]:
        """Fold a chunk in; returns its streamed events (none: nothing to send for it yet)."""

    @abc.abstractmethod
    def finish(self, end: Finish) -> list[dict[str, Any]]:
        """Fold the end in; returns the streamed events that carry the finish reason."""

    def error_events(self, error: ApiError) -> list[dict[str, Any]]:
        """What ends a stream that failed after it began: OpenAI's error body."""
        return [error.body()]

    @abc.abstractmethod
    def whole(self) -> dict[str, Any]:
        """The non-streamed response: every item folded in so far."""

    def usage_chunk(self) -> dict[str, Any]:
        """The ``include_usage`` chunk: no choices, the request's usage."""
        body = self._envelope(self.chunk_object_name, [])
        body["usage"] = usage_dict(self.usage or Usage(0, 0, 0))
        return body


class CompletionBuilder(ResponseBuilder):
    """``text_completion`` objects; logprobs in the legacy completions shape."""

    object_name = chunk_object_name = "text_completion"

    def __init__(
        self,
        response_id: str,
        model: str,
        want_logprobs: bool,
        index: int = 0,
        echo_text: str = "",
        echo_top: int | None = None,
        extras: Extras = NO_EXTRAS,
    ) -> None:
        """``echo_text``: the prompt, returned before the completion (``echo``);
        ``echo_top``: with ``echo`` and ``logprobs``, the alternatives each prompt token's
        logprobs show (the prompt's tokens lead the logprobs; its text then waits for the
        first chunk, which carries them); ``extras``: on the choice."""
        super().__init__(response_id, model, index, extras)
        self.want_logprobs = want_logprobs
        self.echo_text = echo_text
        self.echo_top = echo_top
        self._echo_pending = echo_top is not None
        self.text_parts: list[str] = [echo_text]
        self.text_length = len(echo_text)
        self.logprobs = _empty_completion_logprobs()

    def opening_chunks(self) -> list[dict[str, Any]]:
        """With ``echo``, the prompt's text comes first (with ``logprobs``, in ``add``)."""
        if not self.echo_text or self._echo_pending:
            return []
        return [self._echo_chunk(None)]

    def _echo_chunk(self, logprobs: dict[str, list[Any]] | None) -> dict[str, Any]:
        choice = {"index": self.index, "text": self.echo_text, "logprobs": logprobs,
                  "finish_reason": None, "stop_reason": None}  # fmt: skip
        self._send_token_ids(choice, choice)
        return self._envelope(self.chunk_object_name, [choice])

    def add(self, chunk: Chunk) -> list[dict[str, Any]]:
        self.usage = chunk.usage
        events = []
        if self._echo_pending:  # the first chunk: the prompt's tokens lead the logprobs
            self._echo_pending = False
            assert self.echo_top is not None
            prompt = _echo_logprobs(chunk.prompt_first_token, chunk.prompt_logprobs, self.echo_top)
            for key, values in prompt.items():
                self.logprobs[key].extend(values)
            events.append(self._echo_chunk(prompt))
        self._fold_extras(chunk)
        choice: dict[str, Any] = {
            "index": self.index,
            "text": chunk.text,
            "logprobs": None,
            "finish_reason": None,
            "stop_reason": None,
        }
        if self.want_logprobs:
            part = _legacy_logprobs(chunk.logprobs, self.text_length)
            for key, values in part.items():
                self.logprobs[key].extend(values)
            choice["logprobs"] = part
        self.text_parts.append(chunk.text)
        self.text_length += len(chunk.text)
        self._send_token_ids(choice, choice)
        events.append(self._envelope(self.chunk_object_name, [choice]))
        return events

    def finish(self, end: Finish) -> list[dict[str, Any]]:
        self.usage = end.usage
        choice = {
            "index": self.index,
            "text": "",
            "logprobs": None,
            "finish_reason": end.finish_reason,
            "stop_reason": end.stop_reason,
        }
        self.finish_reason, self.stop_reason = end.finish_reason, end.stop_reason
        return [self._envelope(self.chunk_object_name, [choice])]

    def whole(self) -> dict[str, Any]:
        choice = {
            "index": self.index,
            "text": "".join(self.text_parts),
            "logprobs": self.logprobs if self.want_logprobs else None,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
        }
        self._whole_extras(choice, choice)
        body = self._envelope(self.object_name, [choice])
        body["usage"] = usage_dict(self.usage or Usage(0, 0, 0))
        return body


class ChatBuilder(ResponseBuilder):
    """``chat.completion`` / ``chat.completion.chunk`` objects."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(
        self,
        response_id: str,
        model: str,
        want_logprobs: bool,
        index: int = 0,
        tools: ToolPlan | None = None,
        extras: Extras = NO_EXTRAS,
        echo: str = "",
        reasoning: str = "",
        show_reasoning: bool = True,
    ) -> None:
        """``reasoning``: the model's reasoning format (``client/reasoning.py``; "" none):
        its reasoning streams as ``delta.reasoning_content`` and the message holds it as
        ``reasoning_content`` (unless ``show_reasoning`` is false), the rest goes on as
        content (tool calls are read in it; content logprobs are its tokens'). ``echo``: the
        text the content begins with (``gateway/sampling.py:chat_echo``),
        sent with the opening chunk. ``tools``: the request's shown tools
        (``client/tools.py``): an answer that may be a tool call is held back as content until
        it is known not to be one (it left the format, ``client/tool_call_scanner.py``; with a
        forced choice, never); its calls
        stream as ``delta.tool_calls`` pieces as they are written (``gateway/tools.py``), and
        an answer that is a call ends as ``tool_calls`` with finish reason ``tool_calls``.
        One that stops being a call after its calls began streaming (cut by ``max_tokens``,
        text after the call) ends with its own finish reason and the whole answer as
        content, as the non-streamed response has it. In the ``hermes`` format the answer's
        text before its first ``<tool_call>`` streams as content as it comes (the end that
        could begin the tag held back), its calls as deltas, and the whole message holds that
        content beside the calls (``client/hermes_tools.py``); content logprobs then go with
        the chunks whose text reached the content. ``extras``: the prompt's on the response,
        the generated ids on the choice."""
        super().__init__(response_id, model, index, extras)
        self.want_logprobs = want_logprobs
        self.text_parts: list[str] = []
        self.tools = tools if tools is not None and tools.shown else None
        self._held: list[str] = []
        self._held_logprobs: list[TokenLogprob] = []
        """The held content's logprobs: they go out with it."""
        self._tagged = None if self.tools is None else self._tagged_stream(self.tools)
        self._streams_content = self.tools is None or self._tagged is not None
        self._calls = None if self.tools is None else ToolCallDeltas(self.tools)
        self._content_sent = ""
        """A ``hermes`` answer's content streamed so far."""
        self.tool_calls: list[dict[str, Any]] | None = None
        self.tool_content: str | None = None
        """The content beside the calls (``hermes``; None: none)."""
        self.content_logprobs: list[dict[str, Any]] = []
        self.echo = echo
        self._reasoning = ReasoningStream(reasoning) if reasoning else None
        self._show_reasoning = show_reasoning
        self.reasoning_parts: list[str] = []

    @staticmethod
    def _content_logprobs(logprobs: tuple[TokenLogprob, ...]) -> list[dict[str, Any]]:
        return [
            {
                "token": entry.text,
                "logprob": entry.logprob,
                "bytes": _token_bytes(entry.text),
                "top_logprobs": [
                    {"token": top.text, "logprob": top.logprob, "bytes": _token_bytes(top.text)}
                    for top in entry.top
                ],
            }
            for entry in logprobs
        ]

    @staticmethod
    def _tagged_stream(plan: ToolPlan) -> TaggedStream | None:
        return plan.stream() if plan.tagged else None

    def opening_chunks(self) -> list[dict[str, Any]]:
        """The first streamed chunk: the assistant role, the echoed content (or none)."""
        choice = {
            "index": self.index,
            "delta": {"role": "assistant", "content": self.echo},
            "logprobs": None,
            "finish_reason": None,
        }
        return [self._chunk_event(choice)]

    def add(self, chunk: Chunk) -> list[dict[str, Any]]:
        """The chunk's streamed form: its reasoning (a reasoning model's), its content, or
        the pieces of tool calls it makes known; none while its content is held (it may be a
        call)."""
        self.usage = chunk.usage
        self._fold_extras(chunk)
        if self._reasoning is None:
            return self._add_content(chunk.text, chunk.logprobs)
        thought, text = self._reasoning.feed(chunk.text)
        events = self._thought_events(thought)
        return events + (self._add_content(text, chunk.logprobs) if text else [])

    def _thought_events(self, thought: str) -> list[dict[str, Any]]:
        """A piece of the reasoning as ``delta.reasoning_content`` (none where it is not
        shown, ``include_reasoning: false``)."""
        self.reasoning_parts.append(thought)
        if not thought or not self._show_reasoning:
            return []
        return [self._delta_chunk({"reasoning_content": thought})]

    def _add_content(self, text: str, logprobs: tuple[TokenLogprob, ...]) -> list[dict[str, Any]]:
        """The answer's next piece of content: streamed, held, or read as tool calls."""
        self.text_parts.append(text)
        if self._tagged is not None:
            return self._add_tagged(text, logprobs)
        if not self._streams_content:
            assert self.tools is not None and self._calls is not None
            self._held.append(text)
            self._held_logprobs.extend(logprobs)
            if entries := self._calls.feed(text):
                return [self._delta_chunk({"tool_calls": entries})]
            if self.tools.forced or self._calls.started or not self._calls.failed:
                return []
            self._streams_content, text = True, "".join(self._held)
            logprobs = tuple(self._held_logprobs)
            self._held, self._held_logprobs = [], []
        choice: dict[str, Any] = {
            "index": self.index,
            "delta": {"content": text},
            "logprobs": self._logprobs_part(logprobs),
            "finish_reason": None,
        }
        return [self._chunk_event(choice)]

    def _add_tagged(self, text: str, logprobs: tuple[TokenLogprob, ...]) -> list[dict[str, Any]]:
        """A tagged answer's next piece (``hermes``, ``qwen3_coder``): its content and the
        call deltas it makes known."""
        assert self._tagged is not None and self._calls is not None
        content, pieces = self._tagged.feed(text)
        events = []
        if content:
            self._content_sent += content
            choice = {
                "index": self.index,
                "delta": {"content": content},
                "logprobs": self._logprobs_part(logprobs),
                "finish_reason": None,
            }
            events.append(self._chunk_event(choice))
        if entries := self._calls.entries(pieces):
            events.append(self._delta_chunk({"tool_calls": entries}))
        return events

    def _finish_tagged(self, end: Finish) -> dict[str, Any]:
        """A tagged answer's last delta: the calls a stream still lacks, or, where it makes
        none, the content not streamed yet (held back, or read as a call that was not one)."""
        assert self.tools is not None and self._tagged is not None and self._calls is not None
        text = "".join(self.text_parts)
        answer = self.tools.answer(text)
        self._tagged.finish()
        delta: dict[str, Any] = {}
        if answer is not None and end.finish_reason == "stop":
            if rest := self._calls.rest(answer.calls):
                delta["tool_calls"] = rest
            self.tool_calls = self._calls.whole(answer.calls)
            self.tool_content = answer.content
            self.finish_reason = "tool_calls"
        elif len(text) > len(self._content_sent):
            delta["content"] = text[len(self._content_sent) :]
        return delta

    def _logprobs_part(self, logprobs: tuple[TokenLogprob, ...]) -> dict[str, Any] | None:
        """Content's logprobs as a chunk carries them (folded into the whole response's),
        or None where they were not asked for."""
        if not self.want_logprobs:
            return None
        part = self._content_logprobs(logprobs)
        self.content_logprobs.extend(part)
        return {"content": part}

    def finish(self, end: Finish) -> list[dict[str, Any]]:
        events = []
        if self._reasoning is not None:  # what it held back, as the part it belonged to
            thought, text = self._reasoning.finish()
            events = self._thought_events(thought)
            if text:
                events += self._add_content(text, ())
        return events + self._finish_content(end)

    def _finish_content(self, end: Finish) -> list[dict[str, Any]]:
        self.usage = end.usage
        self.finish_reason, self.stop_reason = end.finish_reason, end.stop_reason
        delta: dict[str, Any] = {}
        logprobs = None
        if self._tagged is not None:
            delta = self._finish_tagged(end)
        elif not self._streams_content:
            assert self.tools is not None and self._calls is not None
            calls = self.tools.parse("".join(self.text_parts))
            if calls and end.finish_reason == "stop":
                if rest := self._calls.rest(calls):
                    delta["tool_calls"] = rest
                self.tool_calls = self._calls.whole(calls)
                self.finish_reason = "tool_calls"
            elif self._held:
                delta["content"] = "".join(self._held)
                logprobs = self._logprobs_part(tuple(self._held_logprobs))
        choice = {
            "index": self.index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": self.finish_reason,
            "stop_reason": end.stop_reason,
        }
        return [self._chunk_event(choice)]

    def _delta_chunk(self, delta: dict[str, Any]) -> dict[str, Any]:
        choice = {"index": self.index, "delta": delta, "logprobs": None, "finish_reason": None}
        return self._chunk_event(choice)

    def _chunk_event(self, choice: dict[str, Any]) -> dict[str, Any]:
        """A streamed chunk of ``choice``, with the token ids it carries (``extras``)."""
        event = self._envelope(self.chunk_object_name, [choice])
        self._send_token_ids(event, choice)
        return event

    def _message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant"}
        if self._reasoning is not None and self._reasoning.reasoned and self._show_reasoning:
            message["reasoning_content"] = "".join(self.reasoning_parts)
        if self.tool_calls:
            content = None if self.tool_content is None else self.echo + self.tool_content
            return {**message, "content": content, "tool_calls": self.tool_calls}
        return {**message, "content": self.echo + "".join(self.text_parts)}

    def whole(self) -> dict[str, Any]:
        choice = {
            "index": self.index,
            "message": self._message(),
            "logprobs": {"content": self.content_logprobs} if self.want_logprobs else None,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
        }
        body = self._envelope(self.object_name, [choice])
        body["usage"] = usage_dict(self.usage or Usage(0, 0, 0))
        self._whole_extras(body, choice)
        return body
