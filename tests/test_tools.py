"""Tool calling in the documented JSON format (``client/tools.py``) and the chat builder's
handling of it: plans from the request, the forced grammar, parsing an answer, content held
back only while it may be a call."""

from __future__ import annotations

import json

import pytest

from splitserve.client import Chunk, Finish, TokenLogprob, Usage
from splitserve.client.tools import ToolPlan, tool_plan
from splitserve.common.errors import InvalidRequestError
from splitserve.common.grammar import GrammarSpec
from splitserve.gateway.responses import ChatBuilder
from tests.sdk_stream import calls_stream_as_whole

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Adds two numbers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}
USAGE = Usage(3, 1, 0)


def _plan(choice: object = None, parallel: bool | None = None) -> ToolPlan:
    plan = tool_plan([ADD, NOW], choice, parallel)
    assert plan is not None
    return plan


def test_plans_follow_tool_choice_and_refuse_what_cannot_be_served() -> None:
    assert _plan().choice == "auto" and not _plan().forced and _plan().shown
    assert not _plan("none").shown and _plan("none").grammar() is None
    assert _plan({"type": "function", "function": {"name": "now"}}).choice == "now"
    assert tool_plan(None, "auto", None) is None
    for tools, choice, param in (
        ([{"type": "function", "function": {"name": "bad name"}}], None, "tools"),
        ([ADD, ADD], None, "tools"),
        ([ADD], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([ADD], "sometimes", "tool_choice"),
        (None, "required", "tool_choice"),
    ):
        with pytest.raises(InvalidRequestError) as refused:
            tool_plan(tools, choice, None)
        assert refused.value.param == param


def test_a_forced_choice_is_a_json_schema_of_the_format() -> None:
    grammar = _plan("required").grammar()
    assert isinstance(grammar, GrammarSpec) and grammar.kind == "json_schema"
    calls = json.loads(grammar.text)["properties"]["tool_calls"]
    assert calls["minItems"] == 1 and "maxItems" not in calls  # parallel by default
    names = [option["properties"]["name"]["const"] for option in calls["items"]["anyOf"]]
    assert names == ["add", "now"]
    one = json.loads(_plan("required", parallel=False).grammar().text)  # type: ignore[union-attr]
    assert one["properties"]["tool_calls"]["maxItems"] == 1
    named = json.loads(_plan({"type": "function", "function": {"name": "add"}}).grammar().text)  # type: ignore[union-attr]
    assert [
        o["properties"]["name"]["const"]
        for o in named["properties"]["tool_calls"]["items"]["anyOf"]
    ] == ["add"]  # noqa: E501


def test_answers_parse_as_calls_only_in_the_format_with_known_names() -> None:
    plan = _plan()
    calls = plan.parse('{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}')
    assert calls is not None and calls[0].name == "add"
    assert json.loads(calls[0].arguments) == {"a": 1, "b": 2}
    for text in ("Hello", '{"tool_calls": []}', '{"tool_calls": [{"name": "mul"}]}', "{"):
        assert plan.parse(text) is None


def _stream(builder: ChatBuilder, pieces: list[str]) -> list[dict]:
    chunks = [
        event for piece in pieces for event in builder.add(Chunk("r", piece, (1,), (), USAGE))
    ]
    return chunks + builder.finish(Finish("r", "stop", None, USAGE))


def test_auto_streams_content_once_it_cannot_be_a_call_and_streams_a_call() -> None:
    content = _stream(ChatBuilder("c", "m", False, tools=_plan()), [" ", "Hi", " there"])
    deltas = [chunk["choices"][0]["delta"].get("content") for chunk in content]
    assert (
        deltas == [" Hi", " there", None] and content[-1]["choices"][0]["finish_reason"] == "stop"
    )
    builder = ChatBuilder("c", "m", False, tools=_plan())
    call = _stream(builder, ['{"tool_calls": [{"name": "now", ', '"arguments": {}}]}'])
    first, rest, final = (chunk["choices"][0] for chunk in call)
    made = first["delta"]["tool_calls"][0]
    assert made["function"] == {"name": "now", "arguments": ""} and made["type"] == "function"
    assert rest["delta"]["tool_calls"] == [{"index": 0, "function": {"arguments": "{}"}}]
    assert final["finish_reason"] == "tool_calls" and final["delta"] == {}
    whole = builder.whole()["choices"][0]
    assert whole["message"]["content"] is None and whole["finish_reason"] == "tool_calls"
    assert whole["message"]["tool_calls"][0]["id"] == made["id"]
    not_a_call = _stream(ChatBuilder("c", "m", False, tools=_plan()), ["{", "oops", "!"])
    released = [chunk["choices"][0]["delta"].get("content") for chunk in not_a_call]
    assert released == ["{oops", "!", None]  # streamed once it left the format


TWO_CALLS = (
    '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": "x}\\"]"}},\n'
    '  {"id": "mine", "arguments": {"b" : [2, {}]}, "name": "add"}, {"name": "now"}]}\n'
)
"""Two of the format's liberties: a brace and a quote inside a string, arguments before the
name (with an extra key), a call without arguments."""


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def test_the_scanner_hands_out_each_calls_arguments_as_written() -> None:
    plan = _plan()
    calls = plan.parse(TWO_CALLS)
    assert calls is not None
    assert [(c.name, c.arguments) for c in calls] == [
        ("add", '{"a": 1, "b": "x}\\"]"}'), ("add", '{"b" : [2, {}]}'), ("now", "{}")
    ]  # fmt: skip
    assert [json.loads(c.arguments) for c in calls] == [
        {"a": 1, "b": 'x}"]'}, {"b": [2, {}]}, {}
    ]  # fmt: skip
    for size in (1, 3, 7, len(TWO_CALLS)):
        scanner = plan.scanner()
        pieces = [piece for text in _pieces(TWO_CALLS, size) for piece in scanner.feed(text)]
        joined = ["".join(p.arguments for p in pieces if p.index == i) for i in range(3)]
        assert joined == [c.arguments for c in calls]
        assert [p.name for p in pieces if p.name is not None] == ["add", "add", "now"]
        assert scanner.finish() == calls
    first = [p for p in plan.scanner().feed(TWO_CALLS[:60]) if p.index == 0]
    assert first[0].name == "add" and "".join(p.arguments for p in first) == '{"a": 1, "b": "'


@pytest.mark.parametrize(
    "text",
    [
        'Sure: {"tool_calls": []}',
        '{"tool_calls": [{"name": "mul", "arguments": {}}]}',
        '{"tool_calls": [{"name": "now"}], "x": 1}',
        '{"tool_calls": [{"name": "now", "name": "add"}]}',
        '{"tool_calls": [{"name": "now"}]} and then some',
        '{"tool_calls": [{"name": "add", "arguments": {"a": 1]}]}',
    ],
)
def test_a_text_that_leaves_the_format_is_no_call_whatever_follows(text: str) -> None:
    plan = _plan()
    scanner = plan.scanner()
    scanner.feed(text)
    assert scanner.finish() is None and plan.parse(text) is None
    assert scanner.failed
    cut = plan.scanner()
    cut.feed('{"tool_calls": [{"name": "add", "arguments": {"a": 1')  # cut by max_tokens
    assert not cut.failed and cut.finish() is None


def test_streamed_tool_calls_reassemble_in_the_openai_sdk_as_the_whole_answer() -> None:
    """The chunks a streamed answer of three calls makes, fed to the openai SDK's stream
    state (what ``client.chat.completions.stream`` accumulates), give the same calls, ids
    and arguments as the non-streamed response; only a call's first delta names it."""
    for size in (1, 4, 50):
        builder = ChatBuilder("c", "m", False, tools=_plan())
        chunks = builder.opening_chunks() + _stream(builder, _pieces(TWO_CALLS, size))
        deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls") or []]
        assert [d["index"] for d in deltas if "id" in d] == [0, 1, 2]
        for delta in deltas:
            assert set(delta) == ({"index", "id", "type", "function"} if "id" in delta
                                  else {"index", "function"})  # fmt: skip
            assert set(delta["function"]) == ({"name", "arguments"} if "id" in delta
                                              else {"arguments"})  # fmt: skip
        _, whole = calls_stream_as_whole(builder, chunks)
        assert json.loads(whole["message"]["tool_calls"][0]["function"]["arguments"])["a"] == 1


def test_a_streamed_call_cut_short_ends_as_the_whole_answer_does() -> None:
    """A call that began streaming but did not end as one (cut by max_tokens) finishes with
    its own reason and the whole text as content, as the non-streamed response has it."""
    builder = ChatBuilder("c", "m", False, tools=_plan())
    text = '{"tool_calls": [{"name": "add", "arguments": {"a": 1'
    pieces = _pieces(text, 5)
    chunks = [c for piece in pieces for c in builder.add(Chunk("r", piece, (1,), (), USAGE))]
    assert any(c["choices"][0]["delta"].get("tool_calls") for c in chunks)
    (final,) = (c["choices"][0] for c in builder.finish(Finish("r", "length", None, USAGE)))
    assert final["finish_reason"] == "length" and final["delta"] == {"content": text}
    assert builder.whole()["choices"][0]["message"] == {"role": "assistant", "content": text}


def test_held_content_keeps_its_logprobs_whole_and_streamed() -> None:
    """Content held while it might be a call goes out with its tokens' logprobs, when it
    leaves the format and when the answer ends still held (cut by length)."""

    def logprob(token: int) -> TokenLogprob:
        return TokenLogprob(token, -0.5 * token, token, f"t{token}", ())

    for pieces, reason in ((["{", "oops", "!"], "stop"), (['{"tool_calls": [', "{"], "length")):
        builder = ChatBuilder("c", "m", True, tools=_plan())
        events = []
        for token, piece in enumerate(pieces, start=1):
            events += builder.add(Chunk("r", piece, (token,), (logprob(token),), USAGE))
        events += builder.finish(Finish("r", reason, None, USAGE))
        streamed = [
            entry["logprob"]
            for event in events
            for choice in event["choices"]
            if choice["logprobs"]
            for entry in choice["logprobs"]["content"]
        ]
        expected = [-0.5 * token for token in range(1, len(pieces) + 1)]
        assert streamed == expected, pieces
        whole = builder.whole()["choices"][0]
        assert [entry["logprob"] for entry in whole["logprobs"]["content"]] == expected
        assert whole["message"]["content"] == "".join(pieces)
