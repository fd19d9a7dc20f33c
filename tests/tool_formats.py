"""Checks the tests of the tool-call formats that show tools to the chat template share
(``tests/test_llama3_tools.py``, ``tests/test_mistral_tools.py``): a whole answer's parse, the
tools reaching the template, a forced choice's grammar."""

from __future__ import annotations

import json
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
