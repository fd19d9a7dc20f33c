"""The check the tool-format tests share: a chat builder's streamed chunks, fed to the openai
SDK's stream state (what ``client.chat.completions.stream`` accumulates), give the calls the
whole response holds."""

from __future__ import annotations

from typing import Any

from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk
from openai.types.chat.parsed_chat_completion import ParsedChoice

from splitserve.client import Chunk, Finish, Usage
from splitserve.client.tools import ToolPlan
from splitserve.gateway.responses import ChatBuilder

USAGE = Usage(3, 1, 0)

_CALL_FIELDS = {"id": True, "type": True, "function": {"name", "arguments"}}


def calls_stream_as_whole(
    builder: ChatBuilder, chunks: list[dict[str, Any]]
) -> tuple[ParsedChoice[Any], dict[str, Any]]:
    """Assert that ``chunks`` (``builder``'s, from its opening to its finish) reassemble in
    the SDK into an answer finished by ``tool_calls`` whose calls (ids, types, names and
    arguments) are the whole response's; the SDK's final choice and the whole response's
    choice, for the caller's own checks."""
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    final = state.get_final_completion().choices[0]
    whole = builder.whole()["choices"][0]
    assert final.finish_reason == whole["finish_reason"] == "tool_calls"
    calls = final.message.tool_calls or []
    reassembled = [call.model_dump(include=_CALL_FIELDS) for call in calls]
    assert reassembled == whole["message"]["tool_calls"]
    return final, whole


def streamed_whole_calls(plan: ToolPlan, answer: str, size: int) -> list[dict[str, Any]]:
    """``answer`` streamed in pieces of ``size`` characters through a chat builder of
    ``plan``: its calls as the whole response holds them, once checked to be what the SDK
    reassembles from the stream (``calls_stream_as_whole``)."""
    builder = ChatBuilder("c", "m", False, tools=plan)
    chunks = builder.opening_chunks()
    for start in range(0, len(answer), size):
        chunks += builder.add(Chunk("r", answer[start : start + size], (1,), (), USAGE))
    chunks += builder.finish(Finish("r", "stop", None, USAGE))
    _, whole = calls_stream_as_whole(builder, chunks)
    return whole["message"]["tool_calls"]


def streamed_content(plan: ToolPlan, pieces: list[str]) -> str:
    """The content a chat builder of ``plan`` streams for an answer of ``pieces``."""
    builder = ChatBuilder("c", "m", False, tools=plan)
    said = [builder.add(Chunk("r", piece, (1,), (), USAGE)) for piece in pieces]
    return "".join(c["choices"][0]["delta"].get("content") or "" for e in said for c in e)
