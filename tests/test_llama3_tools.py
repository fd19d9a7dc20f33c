"""Llama 3's JSON tool calls (``--tool-call-parser llama3_json``, ``client/tools.py``): an
answer of call objects (``parameters`` or ``arguments``, several joined by ``;``, after an
optional ``<|python_tag|>``) is its calls, anything else content; streamed through the chat
builder into the openai SDK's stream state as the whole response has them; a forced choice
takes exactly such calls."""

from __future__ import annotations

import functools

import pytest

from splitserve.client.tools import LLAMA3_JSON_FORMAT, ToolPlan, tool_plan
from splitserve.common.grammar import GrammarCompiler
from tests.sdk_stream import streamed_content, streamed_whole_calls
from tests.tool_formats import assert_parses_to, assert_tools_reach_the_template, forced_takes

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
    assert_parses_to(_plan(), text, calls)


def test_the_builder_streams_the_calls_the_whole_response_holds() -> None:
    for size in (1, 6, 200):
        calls = streamed_whole_calls(_plan(), TWO_CALLS, size)
        assert [c["function"]["arguments"] for c in calls] == ['{"a": 1, "b": 2}', "{}"]
    assert streamed_content(_plan(), ["It is ", "3."]) == "It is 3."


def test_the_tools_go_to_the_chat_template(compiler: GrammarCompiler) -> None:
    assert_tools_reach_the_template([ADD, NOW], LLAMA3_JSON_FORMAT)

    takes = functools.partial(forced_takes, compiler)

    add = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    now = '{"name": "now", "parameters": {}}'
    assert takes(_plan("required", parallel=False), add)
    assert not takes(_plan("required", parallel=False), f"{add}; {now}")
    assert takes(_plan("required"), f"{add}; {now}")
    assert not takes(_plan("required"), f"Sure: {add}")
    assert takes(_plan({"type": "function", "function": {"name": "now"}}), now)
    assert not takes(_plan({"type": "function", "function": {"name": "now"}}), add)
