"""Qwen3-Coder's tool calls (``--tool-call-parser qwen3_coder``, ``client/xml_tools.py``):
``<tool_call>`` blocks of ``<function=NAME>`` and ``<parameter=KEY>`` elements after the
answer's content are its calls, each value read by its parameter's schema type; streamed
through the chat builder into the openai SDK's stream state as the whole answer has them; a
forced choice's structural tag takes exactly such blocks."""

from __future__ import annotations

import functools
import json

import pytest

from splitserve.client.tools import QWEN3_CODER_FORMAT, ToolPlan, tool_plan
from splitserve.common.grammar import GrammarCompiler
from tests.sdk_stream import streamed_content, streamed_whole_calls
from tests.tool_formats import (
    assert_tools_reach_the_template,
    forced_takes,
    serving_tool_format,
    streamed_choice,
)

WRITE = {
    "type": "function",
    "function": {
        "name": "write_file",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "content": {"type": "string"},
                "mode": {"type": "integer"},
                "append": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["path", "content"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
ANSWER = (
    "I will write it <now>.\n"
    "<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n"
    "<parameter=content>\ndef f():\n    return '</function>'\n</parameter>\n"
    "<parameter=mode>\n420\n</parameter>\n<parameter=append>\nFalse\n</parameter>\n"
    '<parameter=tags>\n["x", "y"]\n</parameter>\n</function>\n</tool_call>\n'
    "<tool_call>\n<function=now>\n</function>\n</tool_call>"
)
"""Content before the calls (with a '<' that starts no tag), a closing tag inside a value,
typed values, a call without parameters."""
WRITTEN = {
    "path": "a.py",
    "content": "def f():\n    return '</function>'",
    "mode": 420,
    "append": False,
    "tags": ["x", "y"],
}


def _plan(choice: object = None, parallel: bool | None = None) -> ToolPlan:
    plan = tool_plan([WRITE, NOW], choice, parallel, QWEN3_CODER_FORMAT)
    assert plan is not None
    return plan


def test_answers_parse_to_calls_with_typed_values_and_the_content_before_them() -> None:
    answer = _plan().answer(ANSWER)
    assert answer is not None and answer.content == "I will write it <now>.\n"
    assert [(c.name, json.loads(c.arguments)) for c in answer.calls] == [
        ("write_file", WRITTEN),
        ("now", {}),
    ]
    untyped = ANSWER.replace("420", "rw").replace("False", "maybe")  # kept as written
    calls = (_plan().answer(untyped) or pytest.fail("no calls")).calls
    assert json.loads(calls[0].arguments) | {} == WRITTEN | {"mode": "rw", "append": "maybe"}


@pytest.mark.parametrize(
    "text",
    [
        "No tools needed.",
        "<tool_call>\n<function=delete>\n</function>\n</tool_call>",  # no such tool
        "<tool_call>\n<function=now>\n</tool_call>",  # the function not closed
        "<tool_call>\n<function=now>\n</function>\n",  # the block not closed
        "<tool_call>\n<function=now>\nx</function>\n</tool_call>",  # text in the function
        "<tool_call>\n<function=write_file>\n<parameter=path>\na\n</parameter>\n"
        "<parameter=path>\nb\n</parameter>\n</function>\n</tool_call>",  # a parameter twice
        "<tool_call>\n<function=write_file>\n<parameter=path>\na\n</function>\n</tool_call>",
    ],
)
def test_anything_else_is_content(text: str) -> None:
    assert _plan().answer(text) is None


def test_the_builder_streams_what_the_whole_response_holds() -> None:
    for size in (1, 7, 500):
        calls = streamed_whole_calls(_plan(), ANSWER, size)
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [WRITTEN, {}]
    assert streamed_content(_plan(), ["It is ", "<b>3</b>."]) == "It is <b>3</b>."


def test_the_tools_go_to_the_chat_template_and_a_forced_choice_takes_only_blocks(
    compiler: GrammarCompiler,
) -> None:
    assert_tools_reach_the_template([WRITE, NOW], QWEN3_CODER_FORMAT)

    takes = functools.partial(forced_takes, compiler)

    def block(function: str, *parameters: tuple[str, str]) -> str:
        inner = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in parameters)
        return f"<tool_call>\n<function={function}>\n{inner}</function>\n</tool_call>"

    write = block("write_file", ("path", "a.py"), ("content", "x = 1\ny = 2"), ("mode", "420"))
    now = block("now")
    assert takes(_plan("required", parallel=False), write)
    assert takes(_plan("required", parallel=False), now)
    assert not takes(_plan("required", parallel=False), f"{write}\n{now}")
    assert takes(_plan("required"), f"{write}\n{now}")
    assert not takes(_plan("required"), f"Sure:\n{write}")
    assert not takes(_plan("required"), block("write_file", ("path", "a.py")))  # no content
    assert not takes(_plan("required"), block("write_file", ("content", "x"), ("path", "a")))
    assert not takes(
        _plan("required"), block("write_file", ("path", "a"), ("content", "x"), ("mode", "rw"))
    )
    assert takes(
        _plan("required"),
        block("write_file", ("path", "a"), ("content", "x"), ("tags", '["t"]')),
    )
    assert takes(_plan({"type": "function", "function": {"name": "now"}}), now)
    assert not takes(_plan({"type": "function", "function": {"name": "now"}}), write)
    answer = _plan().answer(f"{write}\n{now}")
    assert answer is not None and json.loads(answer.calls[0].arguments)["mode"] == 420


QWEN3_CODER_LIKE_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call functions. Call one as:
<tool_call>
<function=NAME>
<parameter=KEY>
VALUE
</parameter>
</function>
</tool_call>
The functions:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content or '' }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
"""A ChatML template showing the tools as Qwen3-Coder's does (written here: SmolLM2's shows
none)."""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_cluster_serving_the_qwen3_coder_format(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``--tool-call-parser qwen3_coder``: required and named choices come back as calls with
    typed JSON arguments (the structural tag makes the default model write the blocks),
    whole and streamed alike (the openai SDK). The tools take numbers and flags: a string's
    value is free text up to its end tag, which the 135M default model does not end."""
    from tests.test_llama3_tools import ADD

    with serving_tool_format(tmp_path, "qwen3_coder", QWEN3_CODER_LIKE_TEMPLATE) as sdk:
        model = sdk.models.list().data[0].id
        ask = [{"role": "user", "content": "What is 2 + 3? Use the tool."}]
        asked = {"model": model, "tools": [ADD, NOW], "max_tokens": 80, "temperature": 0}
        whole = sdk.chat.completions.create(
            messages=ask, tool_choice="required", parallel_tool_calls=False, **asked
        )
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls or []
        arguments = json.loads(call.function.arguments)
        assert call.function.name in ("add", "now") and isinstance(arguments, dict)
        streamed = streamed_choice(
            sdk, messages=ask, tool_choice="required", parallel_tool_calls=False, **asked
        )
        assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
            (call.function.name, call.function.arguments)
        ]
        named = sdk.chat.completions.create(
            messages=ask, tool_choice={"type": "function", "function": {"name": "add"}},
            **asked,
        )  # fmt: skip
        (added,) = named.choices[0].message.tool_calls or []
        summands = json.loads(added.function.arguments)
        assert added.function.name == "add" and set(summands) == {"a", "b"}
        assert all(isinstance(value, int) for value in summands.values())  # typed, not text
