"""Hermes-style tool calls (``client/hermes_tools.py``, ``--tool-call-parser hermes``): the
tools go to the chat template, answers of ``<tool_call>`` blocks parse to calls with the text
before them as content, streamed (through the chat builder, into the openai SDK's stream
state) as the whole answer is, and a forced choice's structural tag takes exactly such
blocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from splitserve.client import ChatMessage, ChatTemplate, Chunk, Finish, Usage
from splitserve.client.hermes_tools import TaggedCallStream, parse_tagged
from splitserve.client.tools import HERMES_FORMAT, ToolPlan, tool_plan, tool_request
from splitserve.common.errors import InvalidRequestError
from splitserve.common.grammar import GrammarCompiler
from splitserve.gateway.responses import ChatBuilder
from splitserve.proto.cluster_auth import TOKEN_ENV
from tests.cluster import CREDENTIAL
from tests.conftest import constraint_takes
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
NOW = {
    "type": "function",
    "function": {
        "name": "now",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
USAGE = Usage(3, 1, 0)
NAMES = frozenset({"add", "now"})
ANSWER = (
    "Let me add them <first>.\n"
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "x</tool_call>"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "now"}\n</tool_call>'
)
"""Content before the calls (with a '<' that starts no tag), a closing tag inside a JSON
string, a call without arguments."""


def _plan(choice: object = None, parallel: bool | None = None) -> ToolPlan:
    plan = tool_plan([ADD, NOW], choice, parallel, HERMES_FORMAT)
    assert plan is not None
    return plan


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def test_answers_parse_to_calls_and_the_content_before_them() -> None:
    parsed = parse_tagged(ANSWER, NAMES)
    assert parsed is not None and parsed.content == "Let me add them <first>.\n"
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("add", {"a": 1, "b": "x</tool_call>"}),
        ("now", {}),
    ]
    only = parse_tagged('<tool_call>{"name": "now", "parameters": {"x": 1}}</tool_call>', NAMES)
    assert only is not None and only.content is None and only.calls[0].arguments == '{"x": 1}'
    for no_call in (
        "Just text.",
        '<tool_call>\n{"name": "sub", "arguments": {}}\n</tool_call>',  # no such tool
        '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>',  # not JSON
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}}',  # cut short
        '<tool_call>{"name": "now"}</tool_call><tool_call>{"name": "now"',  # the last is open
    ):
        assert parse_tagged(no_call, NAMES) is None, no_call


@pytest.mark.parametrize("size", [1, 3, 7, 200])
def test_the_stream_lets_content_out_and_announces_calls_as_written(size: int) -> None:
    stream = TaggedCallStream(NAMES)
    content, pieces = "", []
    for piece in _pieces(ANSWER, size):
        text, made = stream.feed(piece)
        content += text
        pieces += made
    assert stream.finish() == ""
    assert content == "Let me add them <first>.\n"
    assert [p.name for p in pieces if p.name] == ["add", "now"]
    for index, call in enumerate(parse_tagged(ANSWER, NAMES).calls):  # type: ignore[union-attr]
        assert "".join(p.arguments for p in pieces if p.index == index) == call.arguments
    plain = TaggedCallStream(NAMES)
    out = "".join(plain.feed(piece)[0] for piece in _pieces("a < b <tool", size))
    assert out + plain.finish() == "a < b <tool"  # a held-back start that never came


def test_the_builder_streams_what_the_whole_response_holds() -> None:
    """Chunks of the answer through the chat builder, into the openai SDK's stream state,
    give the whole response's content and calls (ids included); an answer without a call,
    or whose call does not parse, is all content, whole and streamed."""
    for size in (1, 5, 300):
        builder = ChatBuilder("c", "m", False, tools=_plan())
        chunks = builder.opening_chunks()
        for piece in _pieces(ANSWER, size):
            chunks += builder.add(Chunk("r", piece, (1,), (), USAGE))
        chunks += builder.finish(Finish("r", "stop", None, USAGE))
        final, whole = calls_stream_as_whole(builder, chunks)
        assert final.message.content == whole["message"]["content"] == "Let me add them <first>.\n"
        assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["add", "now"]
    for text in ("No tools needed <here>.", 'Sure: <tool_call>\n{"name": "add", "argu'):
        builder = ChatBuilder("c", "m", False, tools=_plan())
        streamed = ""
        for piece in _pieces(text, 4):
            for chunk in builder.add(Chunk("r", piece, (1,), (), USAGE)):
                streamed += chunk["choices"][0]["delta"].get("content") or ""
        (end,) = builder.finish(Finish("r", "stop", None, USAGE))
        streamed += end["choices"][0]["delta"].get("content") or ""
        message = builder.whole()["choices"][0]["message"]
        assert streamed == message["content"] == text and "tool_calls" not in message


def test_the_tools_go_to_the_chat_template_not_a_system_message() -> None:
    asked = tool_request(
        [ChatMessage("user", "1 + 2?")], None, [ADD], "required", None, HERMES_FORMAT,
        ChatTemplate(kwargs={"enable_thinking": False}),
    )  # fmt: skip
    assert [m.role for m in asked.messages or []] == ["user"]
    assert asked.chat_template is not None
    assert asked.chat_template.kwargs == {"enable_thinking": False, "tools": [ADD]}
    assert asked.sampling is not None and asked.sampling.grammar is not None
    assert asked.sampling.grammar.kind == "structural_tag"
    with pytest.raises(InvalidRequestError) as refused:
        tool_request(
            [ChatMessage("user", "x")], None, [ADD], None, None, HERMES_FORMAT,
            ChatTemplate(kwargs={"tools": []}),
        )  # fmt: skip
    assert refused.value.param == "chat_template_kwargs"


def test_a_forced_choice_takes_only_blocks_of_its_tools(compiler: GrammarCompiler) -> None:
    def takes(plan: ToolPlan, text: str) -> bool:
        grammar = plan.grammar()
        assert grammar is not None
        return constraint_takes(compiler, grammar, text)

    add = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    now = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    assert takes(_plan("required"), add)
    assert takes(_plan("required"), f"{add}\n{now}")
    assert not takes(_plan("required", parallel=False), f"{add}\n{now}")
    assert not takes(_plan("required"), f"Sure. {add}")  # no text around forced calls
    assert takes(_plan({"type": "function", "function": {"name": "now"}}), now)
    assert not takes(_plan({"type": "function", "function": {"name": "now"}}), add)
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": "one", "b": 2}}\n</tool_call>'
    assert not takes(_plan("required"), bad)


HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}You can call functions. Their signatures, in <tools></tools>:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one by writing its name and arguments as JSON in <tool_call></tool_call> tags:
<tool_call>
{"name": <name>, "arguments": <arguments>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages if m.role != 'system' %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{% if m.content %}{{ m.content }}{% endif %}
{%- for call in m.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
"""A ChatML template showing tools as Qwen2.5's does (written here: SmolLM2's shows none)."""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_cluster_serving_the_hermes_format(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``--tool-call-parser hermes`` with ``--chat-template`` (and ``--reasoning-parser
    qwen3``, whose optional reasoning comes before a forced call): the gateway reads the
    formats from the model's info; a required choice answers one ``<tool_call>`` block that
    comes back as the call, whole and streamed alike (the openai SDK); a named choice calls
    that tool; the tools reach the template (the prompt holds their signatures); the Python
    client does the same over gRPC."""
    import openai

    from splitserve.client import Client, Sampling
    from tests.cluster import cluster

    template = tmp_path / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    env = {  # Qwen3's configuration: its tool calls, its reasoning (the tiny model writes none)
        "SPLITSERVE_TOOL_CALL_PARSER": "hermes",
        "SPLITSERVE_REASONING_PARSER": "qwen3",
        "SPLITSERVE_CHAT_TEMPLATE": str(template),
    }
    lines: dict[str, str] = {}
    flags = ("--num-blocks=256", "--threads=1", "--max-model-len=2048")
    with cluster(0, 1, *flags, ready_lines=lines, env=env) as address:
        sdk = openai.OpenAI(
            base_url=f"{lines['splitserve gateway ready']}/v1", api_key="x", max_retries=0
        )
        model = sdk.models.list().data[0].id
        ask = [{"role": "user", "content": "What is 2 + 3? Use the tool."}]
        whole = sdk.chat.completions.create(
            model=model, messages=ask, tools=[ADD, NOW], tool_choice="required",
            max_tokens=60, temperature=0, parallel_tool_calls=False,
        )  # fmt: skip
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls or []
        assert call.function.name in ("add", "now")
        json.loads(call.function.arguments)
        stream = sdk.chat.completions.create(
            model=model, messages=ask, tools=[ADD, NOW], tool_choice="required",
            max_tokens=60, temperature=0, parallel_tool_calls=False, stream=True,
        )  # fmt: skip
        state = ChatCompletionStreamState()
        for chunk in stream:
            state.handle_chunk(chunk)
        streamed = state.get_final_completion().choices[0]
        assert streamed.finish_reason == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
            (call.function.name, call.function.arguments)
        ]
        named = sdk.chat.completions.create(
            model=model, messages=ask, tools=[ADD, NOW], max_tokens=60, temperature=0,
            tool_choice={"type": "function", "function": {"name": "now"}},
        )  # fmt: skip
        assert [c.function.name for c in named.choices[0].message.tool_calls or []] == ["now"]
        tokenized = sdk.post(
            "/../tokenize", cast_to=object,
            body={"messages": ask, "chat_template_kwargs": {"tools": [ADD]}},
        )  # fmt: skip
        assert isinstance(tokenized, dict) and tokenized["count"] > 0
        with Client(address) as client:
            info = client.model_info()
            assert (info.tool_call_format, info.reasoning_format) == ("hermes", "qwen3")
            generation = client.generate(
                messages=[ChatMessage("user", "What time is it?")],
                tools=[ADD, NOW], tool_choice={"type": "function", "function": {"name": "now"}},
                sampling=Sampling(max_tokens=40, temperature=0.0),
            )  # fmt: skip
            assert generation.finish_reason == "tool_calls"
            assert [c.name for c in generation.tool_calls] == ["now"]
            assert generation.text.startswith("<tool_call>")


def test_a_coordinator_asked_for_hermes_needs_a_template_that_shows_tools() -> None:
    """The default model's template shows no tools: ``--tool-call-parser hermes`` without a
    ``--chat-template`` that does is a usage error (exit 2) naming what to give."""
    refused = subprocess.run(
        [sys.executable, "-m", "splitserve.coordinator.main", "--port=0", "--internal-port=0",
         "--tool-call-parser=hermes"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, TOKEN_ENV: CREDENTIAL.token},
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    assert "--tool-call-parser hermes needs a chat template that shows the tools" in (
        refused.stderr
    )
