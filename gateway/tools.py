"""Tool calls in OpenAI's response shape (the plan and its format: ``client/tools.py``)."""

from __future__ import annotations

import uuid
from typing import Any

from splitserve.client.tools import ToolCall


def openai_tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """OpenAI's ``tool_calls`` list (ids fresh per call)."""
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call in calls
    ]
