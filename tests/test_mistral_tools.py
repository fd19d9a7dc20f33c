"""Mistral's tool calls (``--tool-call-parser mistral``, ``client/tools.py``): the tools go to
the chat template; an answer that is a JSON array of call objects (after an optional
``[TOOL_CALLS]``) is its calls, anything else content; streamed through the chat builder into
the openai SDK's stream state as the whole response has them, with the 9-character call ids
Mistral's templates take back; a forced choice takes exactly such arrays; a cluster serving
the format answers a forced call and takes it back in the next turn's history."""

from __future__ import annotations

import functools
import re

import pytest

from splitserve.client.tools import MISTRAL_FORMAT, ToolPlan, tool_plan
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

TWO_CALLS = (
    '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}, '
    '{"name": "now", "arguments": {}, "id": "x"}]'
)
CALL_ID = re.compile(r"[A-Za-z0-9]{9}")


def _plan(choice: object = None, parallel: bool | None = None) -> ToolPlan:
    plan = tool_plan([ADD, NOW], choice, parallel, MISTRAL_FORMAT)
    assert plan is not None
    return plan


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        (TWO_CALLS, [("add", {"a": 1, "b": 2}), ("now", {})]),
        ('[{"name": "now", "arguments": {"tz": "UTC"}}]', [("now", {"tz": "UTC"})]),  # no tag
        ('  [TOOL_CALLS][ {"name": "now"} ]  ', [("now", {})]),
        ("[TOOL_CALLS][]", None),  # no call
        ('[{"name": "sub", "arguments": {}}]', None),  # no such tool
        ('Sure: [{"name": "now"}]', None),  # text before
        ('[{"name": "now"}] done', None),  # text after
        ('{"name": "now"}', None),  # an object, not an array
        ('[TOOL_CALL][{"name": "now"}]', None),  # not the tag
        ('[{"name": "now", "arguments": {,}}]', None),  # not JSON
        ('[{"name": "add", "arguments": {"a": 1', None),  # cut short
        ("[1, 2]", None),  # an array of something else
    ],
)
def test_answers_are_calls_only_when_they_are_an_array_of_calls(
    text: str, calls: list[tuple[str, dict]] | None
) -> None:
    assert_parses_to(_plan(), text, calls)


def test_the_builder_streams_the_calls_the_whole_response_holds_with_mistral_ids() -> None:
    for size in (1, 6, 200):
        calls = streamed_whole_calls(_plan(), TWO_CALLS, size)
        assert [c["function"]["arguments"] for c in calls] == ['{"a": 1, "b": 2}', "{}"]
        assert all(CALL_ID.fullmatch(c["id"]) for c in calls), calls
        assert len({c["id"] for c in calls}) == 2
    assert streamed_content(_plan(), ["[It is ", "3.]"]) == "[It is 3.]"


def test_the_tools_go_to_the_chat_template_and_a_forced_choice_is_an_array(
    compiler: GrammarCompiler,
) -> None:
    assert_tools_reach_the_template([ADD, NOW], MISTRAL_FORMAT)

    takes = functools.partial(forced_takes, compiler)

    add = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    now = '{"name": "now", "arguments": {}}'
    assert takes(_plan("required", parallel=False), f"[{add}]")
    assert not takes(_plan("required", parallel=False), f"[{add}, {now}]")
    assert takes(_plan("required"), f"[{add}, {now}]")
    assert not takes(_plan("required"), "[]")
    assert not takes(_plan("required"), f"Sure: [{add}]")
    assert not takes(_plan("required"), '[{"name": "add", "arguments": {"a": "one", "b": 2}}]')
    assert takes(_plan({"type": "function", "function": {"name": "now"}}), f"[{now}]")
    assert not takes(_plan({"type": "function", "function": {"name": "now"}}), f"[{add}]")


def test_the_coordinator_offers_every_format_the_client_reads() -> None:
    from splitserve.client.tools import TOOL_FORMATS
    from splitserve.coordinator.settings import CoordinatorSettings

    field = CoordinatorSettings.__dataclass_fields__["tool_call_parser"]
    assert field.metadata["splitserve.setting"].choices == TOOL_FORMATS


MISTRAL_LIKE_TEMPLATE = """\
{%- for m in messages %}
{%- if m.role == 'user' %}
{%- if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif -%}
[INST]{{ m.content }}[/INST]
{%- elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS][
{%- for call in m.tool_calls %}
{%- if call.id | length != 9 %}{{ raise_exception('call ids must be 9 characters') }}{% endif -%}
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments }}, "id": \
"{{ call.id }}"}{% if not loop.last %}, {% endif %}
{%- endfor %}]</s>
{%- elif m.role == 'assistant' %}{{ m.content }}</s>
{%- elif m.role == 'tool' %}
{%- if m.tool_call_id | length != 9 %}{{ raise_exception('call ids must be 9 characters') }}\
{% endif -%}
[TOOL_RESULTS]{"content": {{ m.content | tojson }}, "call_id": "{{ m.tool_call_id }}"}\
[/TOOL_RESULTS]
{%- endif %}
{%- endfor %}"""
"""A template in the manner of Mistral's v3 ones (written here: SmolLM2's shows no tools),
refusing call ids that are not 9 characters, as theirs do."""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_cluster_serving_the_mistral_format(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``--tool-call-parser mistral`` with a template of Mistral's kind: a required choice
    comes back as one call with a 9-character id, whole and streamed alike (the openai SDK);
    the next turn, sending that call and its result back, is taken by the template (which
    refuses other ids: a 400 for one)."""
    import openai

    with serving_tool_format(tmp_path, "mistral", MISTRAL_LIKE_TEMPLATE) as sdk:
        model = sdk.models.list().data[0].id
        ask = [{"role": "user", "content": "What is 2 + 3? Use the tool."}]
        asked = {"model": model, "tools": [ADD, NOW], "max_tokens": 60, "temperature": 0}
        whole = sdk.chat.completions.create(
            messages=ask, tool_choice="required", parallel_tool_calls=False, **asked
        )
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls or []
        assert call.function.name in ("add", "now") and CALL_ID.fullmatch(call.id), call
        streamed = streamed_choice(
            sdk, messages=ask, tool_choice="required", parallel_tool_calls=False, **asked
        )
        assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
            (call.function.name, call.function.arguments)
        ]
        assert CALL_ID.fullmatch(streamed.message.tool_calls[0].id)
        history = [
            *ask,
            {"role": "assistant", "tool_calls": [call.model_dump(exclude_none=True)]},
            {"role": "tool", "tool_call_id": call.id, "content": "5"},
        ]
        answer = sdk.chat.completions.create(messages=history, tool_choice="none", **asked)
        assert answer.choices[0].finish_reason in ("stop", "length")
        history[-1]["tool_call_id"] = "call_0123456789"
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.chat.completions.create(messages=history, **asked)
        assert "9 characters" in str(refused.value)
