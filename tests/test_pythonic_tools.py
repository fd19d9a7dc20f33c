"""Pythonic tool calls (``--tool-call-parser pythonic``, ``client/pythonic_tools.py``): an
answer that is a Python list of calls with literal keyword arguments is its calls (their
arguments as JSON), anything else content; streamed through the chat builder into the openai
SDK's stream state as the whole response has them; the tools go to the chat template; a
forced choice's grammar takes exactly such lists of the allowed tools."""

from __future__ import annotations

import functools

import pytest

from splitserve.client.tools import PYTHONIC_FORMAT, ToolPlan, tool_plan
from splitserve.common.grammar import GrammarCompiler
from tests.sdk_stream import streamed_content, streamed_whole_calls
from tests.test_llama3_tools import ADD, NOW
from tests.tool_formats import (
    assert_parses_to,
    assert_tools_reach_the_template,
    forced_takes,
    serving_tool_format,
    streamed_choice,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "metric": {"type": "boolean"}},
        },
    },
}
TWO_CALLS = '[add(a=1, b=2), get_weather(city="Pa)ris, \\"FR\\"", metric=True)]'


def _plan(choice: object = None, parallel: bool | None = None) -> ToolPlan:
    plan = tool_plan([ADD, NOW, WEATHER], choice, parallel, PYTHONIC_FORMAT)
    assert plan is not None
    return plan


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        (
            TWO_CALLS,
            [("add", {"a": 1, "b": 2}), ("get_weather", {"city": 'Pa)ris, "FR"', "metric": True})],
        ),
        ("<|python_start|>[now()]<|python_end|>", [("now", {})]),
        (
            "  [now( ) ,add(a=[1, (2, 3)], b={'k': None})]  ",
            [("now", {}), ("add", {"a": [1, [2, 3]], "b": {"k": None}})],
        ),
        ("[]", None),  # no call
        ("[sub()]", None),  # no such tool
        ("Sure: [now()]", None),  # text before
        ("[now()] done", None),  # text after
        ("[now(1)]", None),  # a positional argument
        ("[add(**x)]", None),  # not keywords
        ("[add(a=x)]", None),  # a name, not a literal
        ("[add(a=1, a=2)]", None),  # a keyword twice
        ("[add(a={1, 2})]", None),  # a set: no JSON for it
        ("[now()", None),  # cut short
        ("[now ()]", None),  # a name apart from its parenthesis
        ('{"name": "now"}', None),  # another format
    ],
)
def test_answers_are_calls_only_when_they_are_a_list_of_calls(
    text: str, calls: list[tuple[str, dict]] | None
) -> None:
    assert_parses_to(_plan(), text, calls)


def test_the_builder_streams_the_calls_the_whole_response_holds() -> None:
    for size in (1, 6, 200):
        calls = streamed_whole_calls(_plan(), TWO_CALLS, size)
        assert [c["function"]["arguments"] for c in calls] == [
            '{"a": 1, "b": 2}',
            '{"city": "Pa)ris, \\"FR\\"", "metric": true}',
        ]
    assert streamed_content(_plan(), ["It is ", "3."]) == "It is 3."
    assert streamed_content(_plan(), ["[1, ", "2]"]) == "[1, 2]"


def test_the_tools_go_to_the_chat_template_and_a_forced_choice_takes_only_such_lists(
    compiler: GrammarCompiler,
) -> None:
    assert_tools_reach_the_template([ADD, NOW], PYTHONIC_FORMAT)

    takes = functools.partial(forced_takes, compiler)

    add, now = "add(a=1, b=-2)", "now()"
    weather = 'get_weather(city="Paris", metric=False)'
    assert takes(_plan("required", parallel=False), f"[{add}]")
    assert takes(_plan("required", parallel=False), f"[{weather}]")
    assert not takes(_plan("required", parallel=False), f"[{add}, {now}]")
    assert takes(_plan("required"), f"[{add}, {now}, {weather}]")
    assert not takes(_plan("required"), "[]")
    assert not takes(_plan("required"), f"Sure: [{add}]")
    assert not takes(_plan("required"), '[add(a="one", b=2)]')  # a string for an integer
    assert not takes(_plan("required"), "[add(c=1)]")  # no such parameter
    assert not takes(_plan("required"), "[add(a=1, b=2, a=3)]")  # a parameter twice
    assert not takes(_plan("required"), "[add(b=2, a=1)]")  # out of the schema's order
    assert not takes(_plan("required"), "[add(a=1)]")  # a required one missing
    assert takes(_plan("required"), "[get_weather()]")  # none required
    assert takes(_plan("required"), "[get_weather(metric=True)]")
    assert not takes(_plan("required"), '[get_weather(city="Paris", metric=1)]')
    assert takes(_plan({"type": "function", "function": {"name": "now"}}), f"[{now}]")
    assert not takes(_plan({"type": "function", "function": {"name": "now"}}), f"[{add}]")
    for text in (f"[{add}, {now}, {weather}]", f"[{add}]"):
        assert _plan().parse(text) is not None  # what the grammar takes parses to calls


PYTHONIC_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You can call functions, answering a Python list of calls such as [name(key=value)]:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}[{% for call in m.tool_calls %}{{ call.function.name }}(...)\
{% endfor %}]{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
"""A ChatML template showing the tools (written here: SmolLM2's shows none)."""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_cluster_serving_the_pythonic_format(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``--tool-call-parser pythonic``: a required choice and a named one come back as calls
    with JSON arguments (the grammar makes the default model write a Python list of them),
    whole and streamed alike (the openai SDK)."""
    import json

    with serving_tool_format(tmp_path, "pythonic", PYTHONIC_TEMPLATE) as sdk:
        model = sdk.models.list().data[0].id
        ask = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
        asked = {"model": model, "tools": [ADD, WEATHER], "max_tokens": 60, "temperature": 0}
        whole = sdk.chat.completions.create(messages=ask, tool_choice="required", **asked)
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        assert calls and all(name in ("add", "get_weather") for name, _ in calls)
        assert all(isinstance(json.loads(arguments), dict) for _, arguments in calls)
        streamed = streamed_choice(sdk, messages=ask, tool_choice="required", **asked)
        assert streamed.finish_reason == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == (
            calls
        )
        named = sdk.chat.completions.create(
            messages=ask, tool_choice={"type": "function", "function": {"name": "add"}}, **asked
        )
        assert [c.function.name for c in named.choices[0].message.tool_calls or []] == ["add"], (
            named.choices[0]
        )
