"""Llama 3's JSON tool calls (``--tool-call-parser llama3_json``, ``client/tools.py``): an
answer of call objects (``parameters`` or ``arguments``, several joined by ``;``, after an
optional ``<|python_tag|>``) is its calls, anything else content; streamed through the chat
builder into the openai SDK's stream state as the whole response has them; a forced choice
takes exactly such calls."""

from __future__ import annotations

import json

import pytest

from splitserve.client import ChatMessage, Chunk, Finish, Usage
from splitserve.client.tools import LLAMA3_JSON_FORMAT, ToolPlan, tool_plan, tool_request
from splitserve.common.grammar import GrammarCompiler
from splitserve.gateway.responses import ChatBuilder
from tests.conftest import constraint_takes
from tests.sdk_stream import calls_stream_as_whole

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
USAGE = Usage(3, 1, 0)
TWO_CALLS = '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "now", "arguments": {}}'


def _plan(choice: object = None, parallel: bool | None = None) -> ToolPlan:
    plan = tool_plan([ADD, NOW], choice, parallel, LLAMA3_JSON_FORMAT)
    assert plan is not None
    return plan


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        (TWO_CALLS, [("add", {"a": 1, "b": 2}), ("now", {})]),
        ('<|python_tag|>{"name": "now", "parameters": {"tz": "UTC"}}', [("now", {"tz": "UTC"})]),
        ('  {"name": "now"}  ', [("now", {})]),
        ('{"name": "sub", "parameters": {}}', None),  # no such tool
        ('Sure: {"name": "now"}', None),  # text before
        ('{"name": "now"} done', None),  # text after
        ('{"name": "now", "parameters": {,}}', None),  # not JSON
        ('{"name": "add", "parameters": {"a": 1', None),  # cut short
    ],
)
def test_answers_are_calls_only_when_they_are_call_objects(
    text: str, calls: list[tuple[str, dict]] | None
) -> None:
    parsed = _plan().parse(text)
    if calls is None:
        assert parsed is None
    else:
        assert [(c.name, json.loads(c.arguments)) for c in parsed or []] == calls


def test_the_builder_streams_the_calls_the_whole_response_holds() -> None:
    for size in (1, 6, 200):
        builder = ChatBuilder("c", "m", False, tools=_plan())
        chunks = builder.opening_chunks()
        for start in range(0, len(TWO_CALLS), size):
            piece = TWO_CALLS[start : start + size]
            chunks += builder.add(Chunk("r", piece, (1,), (), USAGE))
        chunks += builder.finish(Finish("r", "stop", None, USAGE))
        _, whole = calls_stream_as_whole(builder, chunks)
        calls = whole["message"]["tool_calls"]
        assert [c["function"]["arguments"] for c in calls] == ['{"a": 1, "b": 2}', "{}"]
    plain = ChatBuilder("c", "m", False, tools=_plan())
    said = [plain.add(Chunk("r", piece, (1,), (), USAGE)) for piece in ("It is ", "3.")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for e in said for c in e) == (
        "It is 3."
    )


def test_the_tools_go_to_the_chat_template(compiler: GrammarCompiler) -> None:
    asked = tool_request(
        [ChatMessage("user", "1 + 2?")], None, [ADD, NOW], "required", None, LLAMA3_JSON_FORMAT
    )
    assert [m.role for m in asked.messages or []] == ["user"]
    assert asked.chat_template is not None and asked.chat_template.kwargs == {"tools": [ADD, NOW]}

    def takes(plan: ToolPlan, text: str) -> bool:
        grammar = plan.grammar()
        assert grammar is not None
        return constraint_takes(compiler, grammar, text)

    add = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    now = '{"name": "now", "parameters": {}}'
    assert takes(_plan("required", parallel=False), add)
    assert not takes(_plan("required", parallel=False), f"{add}; {now}")
    assert takes(_plan("required"), f"{add}; {now}")
    assert not takes(_plan("required"), f"Sure: {add}")
    assert takes(_plan({"type": "function", "function": {"name": "now"}}), now)
    assert not takes(_plan({"type": "function", "function": {"name": "now"}}), add)
