"""Checks the tests of the tool-call formats that show tools to the chat template share
(``tests/test_llama3_tools.py``, ``tests/test_mistral_tools.py``,
``tests/test_pythonic_tools.py``): a whole answer's parse, the tools reaching the template, a
forced choice's grammar, and a cluster serving a format."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from splitserve.client import ChatMessage
from splitserve.client.tools import ToolPlan, tool_request
from splitserve.common.grammar import GrammarCompiler
from tests.conftest import constraint_takes


def assert_parses_to(plan: ToolPlan, text: str, calls: list[tuple[str, dict]] | None) -> None:
    """``plan.parse(text)`` is None where ``calls`` is, else those (name, arguments) pairs."""
    parsed = plan.parse(text)
    if calls is None:
        assert parsed is None
    else:
        assert [(c.name, json.loads(c.arguments)) for c in parsed or []] == calls


def assert_tools_reach_the_template(tools: list[dict[str, Any]], tool_format: str) -> None:
    """A required choice in ``tool_format`` adds no system message: the chat template gets
    the tools as sent, as its ``tools`` variable."""
    asked = tool_request(
        [ChatMessage("user", "1 + 2?")], None, tools, "required", None, tool_format
    )
    assert [m.role for m in asked.messages or []] == ["user"]
    assert asked.chat_template is not None and asked.chat_template.kwargs == {"tools": tools}


def forced_takes(compiler: GrammarCompiler, plan: ToolPlan, text: str) -> bool:
    """Whether ``plan``'s forced-choice grammar takes ``text``."""
    grammar = plan.grammar()
    assert grammar is not None
    return constraint_takes(compiler, grammar, text)


@contextlib.contextmanager
def serving_tool_format(tmp_path: Path, tool_format: str, template: str) -> Iterator[Any]:
    """A cluster (a coordinator and one worker) whose coordinator reads ``tool_format`` and
    renders ``template``; yields an openai SDK client of its gateway (untyped here: the tests
    import openai only where they use it)."""
    import openai

    from tests.cluster import cluster

    path = tmp_path / "template.jinja"
    path.write_text(template)
    env = {"SPLITSERVE_TOOL_CALL_PARSER": tool_format, "SPLITSERVE_CHAT_TEMPLATE": str(path)}
    lines: dict[str, str] = {}
    flags = ("--num-blocks=256", "--threads=1", "--max-model-len=2048")
    with cluster(0, 1, *flags, ready_lines=lines, env=env):
        base_url = f"{lines['splitserve gateway ready']}/v1"
        yield openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)


def streamed_choice(sdk: Any, **create: Any) -> Any:
    """The choice the SDK's stream state assembles from a streamed chat completion."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state = ChatCompletionStreamState()
    for chunk in sdk.chat.completions.create(stream=True, **create):
        state.handle_chunk(chunk)
    return state.get_final_completion().choices[0]
