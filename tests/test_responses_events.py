"""``gateway/responses_events.py:ResponsesBuilder`` on hand-made chunks: the Responses API's
event order and numbering, the final event by finish reason, an answer of no text, and the
error event that ends a stream which failed after it began (the paths a served cluster
rarely takes; ``test_gateway_responses.py`` drives the served ones)."""

from __future__ import annotations

from typing import Any

from splitserve.client import Chunk, Finish, Usage
from splitserve.gateway.errors import ApiError
from splitserve.gateway.responses_events import ResponsesBuilder
from splitserve.gateway.responses_schemas import ResponseObject, ResponsesRequest

USAGE = Usage(7, 2, 3)


def _builder() -> ResponsesBuilder:
    return ResponsesBuilder("resp-r", "m", ResponsesRequest(input="hi"), None)


def _stream(builder: ResponsesBuilder, pieces: list[str], reason: str) -> list[dict[str, Any]]:
    events = builder.opening_chunks()
    for piece in pieces:
        events += builder.add(Chunk("r", piece, (1,), (), USAGE))
    return events + builder.finish(Finish("r", reason, None, USAGE))


def test_text_streams_in_order_and_the_last_event_is_the_whole_response() -> None:
    builder = _builder()
    events = _stream(builder, ["Hello", " there"], "stop")
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert [event["type"] for event in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert (
        events[0]["response"]["status"] == "in_progress" and events[0]["response"]["usage"] is None
    )
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == [
        "Hello", " there"
    ]  # fmt: skip
    assert events[2]["item"]["content"] == [] and events[8]["item"]["status"] == "completed"
    final = events[-1]["response"]
    assert final == builder.whole()
    ResponseObject.model_validate(final)
    assert final["output"][0]["content"][0]["text"] == "Hello there"
    assert final["usage"]["input_tokens_details"] == {"cached_tokens": 3}
    assert final["usage"]["total_tokens"] == 9


def test_the_finish_reason_decides_the_last_event() -> None:
    cut = _stream(_builder(), ["a"], "length")[-1]
    assert cut["type"] == "response.incomplete"
    assert cut["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["response"]["output"][0]["status"] == "incomplete"
    cancelled = _stream(_builder(), ["a"], "abort")[-1]
    assert cancelled["type"] == "response.failed"
    assert cancelled["response"]["status"] == "cancelled" and cancelled["response"]["error"]


def test_an_answer_of_no_text_is_one_empty_message() -> None:
    events = _stream(_builder(), [], "stop")
    final = events[-1]["response"]
    assert [item["content"][0]["text"] for item in final["output"]] == [""]
    assert "response.output_text.delta" not in [event["type"] for event in events]


def test_a_failure_mid_stream_is_an_error_event_in_sequence() -> None:
    builder = _builder()
    events = _stream(builder, ["a"], "stop")
    refused = ApiError(429, "busy", type="rate_limit_error", code="rate_limit_exceeded")
    (error,) = builder.error_events(refused)
    assert error == {"type": "error", "sequence_number": len(events), "code":
                     "rate_limit_exceeded", "message": "busy", "param": None}  # fmt: skip
    (invalid,) = builder.error_events(ApiError(400, "bad", param="input"))
    assert invalid["code"] == "invalid_request_error" and invalid["param"] == "input"
