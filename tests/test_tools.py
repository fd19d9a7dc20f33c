"""Tool calling in the documented JSON format (``client/tools.py``) and the chat builder's
handling of it: plans from the request, the forced grammar, parsing an answer, content held
back only while it may be a call."""

from __future__ import annotations

import json

import pytest

from splitserve.client import Chunk, Finish, Usage
from splitserve.client.tools import ToolPlan, render_tool_calls, tool_plan
from splitserve.common.errors import InvalidRequestError
from splitserve.common.grammar import GrammarSpec
from splitserve.gateway.responses import ChatBuilder

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
    rendered = render_tool_calls([{"function": {"name": "add", "arguments": '{"a": 1}'}}])
    assert json.loads(rendered) == {"tool_calls": [{"name": "add", "arguments": {"a": 1}}]}


def _stream(builder: ChatBuilder, pieces: list[str]) -> list[dict]:
    chunks = [builder.add(Chunk("r", piece, (1,), (), USAGE)) for piece in pieces]
    chunks.append(builder.finish(Finish("r", "stop", None, USAGE)))
    return [chunk for chunk in chunks if chunk is not None]


def test_auto_streams_content_once_it_cannot_be_a_call_and_holds_a_call() -> None:
    content = _stream(ChatBuilder("c", "m", False, tools=_plan()), [" ", "Hi", " there"])
    deltas = [chunk["choices"][0]["delta"].get("content") for chunk in content]
    assert (
        deltas == [" Hi", " there", None] and content[-1]["choices"][0]["finish_reason"] == "stop"
    )
    builder = ChatBuilder("c", "m", False, tools=_plan())
    call = _stream(builder, ['{"tool_calls": [{"name": "now", ', '"arguments": {}}]}'])
    assert len(call) == 1  # held until the end
    final = call[0]["choices"][0]
    assert final["finish_reason"] == "tool_calls"
    assert final["delta"]["tool_calls"][0]["function"]["name"] == "now"
    whole = builder.whole()["choices"][0]
    assert whole["message"]["content"] is None and whole["finish_reason"] == "tool_calls"
    not_a_call = _stream(ChatBuilder("c", "m", False, tools=_plan()), ["{", "oops"])
    assert not_a_call[-1]["choices"][0]["delta"]["content"] == "{oops"
