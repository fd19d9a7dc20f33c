"""Reasoning models (``client/reasoning.py``, ``--reasoning-parser``): answers split into
reasoning and content the same way whole and however they are cut into pieces; the chat
builder streams the reasoning as ``delta.reasoning_content`` and holds it in the message
(tool calls read in the content only); a constraint applies after the reasoning; the
in-process engine's output under such a constraint has the form."""

from __future__ import annotations

import json
import re

import pytest

from splitserve.client import Chunk, Finish, Generation, Usage
from splitserve.client.reasoning import ReasoningStream, after_reasoning, split_reasoning
from splitserve.client.tools import HERMES_FORMAT, tool_plan, with_tool_calls
from splitserve.common.grammar import GrammarCompiler, GrammarSpec
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.checkpoint import LoadedCheckpoint
from splitserve.gateway.responses import ChatBuilder
from tests.conftest import assert_no_leaks, constraint_takes, make_llm

USAGE = Usage(3, 1, 0)
# (format, answer, reasoning, content)
SPLITS = [
    ("qwen3", "<think>\nSum: 2 + 3.\n</think>\n\nIt is 5.", "\nSum: 2 + 3.\n", "\n\nIt is 5."),
    ("qwen3", "  <think>a < b</think>b", "a < b", "b"),
    ("qwen3", "It is 5.", None, "It is 5."),
    ("qwen3", "<thin", None, "<thin"),  # cut before its tag was whole: content
    ("qwen3", "<think>cut by length", "cut by length", ""),
    ("deepseek_r1", "Sum: 2 + 3.</think>It is 5.", "Sum: 2 + 3.", "It is 5."),
    ("deepseek_r1", "<think>Sum.</think>5", "Sum.", "5"),  # a <think> written anyway
    ("deepseek_r1", "never closed", "never closed", ""),
    ("deepseek_r1", "", "", ""),
]


@pytest.mark.parametrize(("fmt", "text", "reasoning", "content"), SPLITS)
def test_answers_split_the_same_whole_and_in_pieces(
    fmt: str, text: str, reasoning: str | None, content: str
) -> None:
    whole = split_reasoning(text, fmt)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for size in (1, 2, 3, 7):
        stream = ReasoningStream(fmt)
        thought = said = ""
        for start in range(0, len(text), size):
            piece_thought, piece_said = stream.feed(text[start : start + size])
            thought, said = thought + piece_thought, said + piece_said
        rest_thought, rest_said = stream.finish()
        assert (thought + rest_thought, said + rest_said) == (reasoning or "", content), size
        assert stream.reasoned is (reasoning is not None)


def _built(builder: ChatBuilder, text: str, size: int) -> tuple[list[dict], dict]:
    chunks = []
    for start in range(0, len(text), size):
        chunks += builder.add(Chunk("r", text[start : start + size], (1,), (), USAGE))
    chunks += builder.finish(Finish("r", "stop", None, USAGE))
    return chunks, builder.whole()["choices"][0]


def _joined(chunks: list[dict], field: str) -> str:
    return "".join(c["choices"][0]["delta"].get(field) or "" for c in chunks)


def test_the_builder_streams_reasoning_apart_from_content() -> None:
    text = "<think>\nThe user greets me.\n</think>\n\nHello!"
    for size in (1, 4, 100):
        chunks, whole = _built(ChatBuilder("c", "m", False, reasoning="qwen3"), text, size)
        assert _joined(chunks, "reasoning_content") == whole["message"]["reasoning_content"]
        assert whole["message"]["reasoning_content"] == "\nThe user greets me.\n"
        assert _joined(chunks, "content") == whole["message"]["content"] == "\n\nHello!"
    hidden_chunks, hidden = _built(
        ChatBuilder("c", "m", False, reasoning="qwen3", show_reasoning=False), text, 3
    )
    assert "reasoning_content" not in hidden["message"]
    assert not _joined(hidden_chunks, "reasoning_content")
    assert hidden["message"]["content"] == "\n\nHello!"
    _, plain = _built(ChatBuilder("c", "m", False, reasoning="qwen3"), "Hello!", 2)
    assert "reasoning_content" not in plain["message"]  # it wrote none


def test_tool_calls_are_read_in_the_content_after_the_reasoning() -> None:
    """A Qwen3-like answer: reasoning naming the tag, then a Hermes call: the call is the
    content's, the tag inside the reasoning is not a call."""
    add = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    plan = tool_plan([add], None, None, HERMES_FORMAT)
    text = (
        "<think>I should write <tool_call> for add.</think>\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    )
    chunks, whole = _built(ChatBuilder("c", "m", False, tools=plan, reasoning="qwen3"), text, 5)
    message = whole["message"]
    assert whole["finish_reason"] == "tool_calls"
    assert message["reasoning_content"] == "I should write <tool_call> for add."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["add"]
    assert message["content"] is None  # only a line break before the call: none
    generation = Generation("r", text, (), (), "stop", None, USAGE)
    parsed = with_tool_calls(generation, plan, "qwen3")
    assert parsed.reasoning == "I should write <tool_call> for add."
    assert [c.name for c in parsed.tool_calls] == ["add"] and parsed.text == text


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_a_constraint_applies_after_the_reasoning(compiler: GrammarCompiler) -> None:
    qwen = after_reasoning(GrammarSpec.json_schema(SCHEMA), "qwen3")
    assert constraint_takes(compiler, qwen, '<think>Let me see {not json}.</think>\n\n{"a": 1}')
    assert constraint_takes(compiler, qwen, '{"a": 1}')  # thinking off: no reasoning block
    assert not constraint_takes(compiler, qwen, 'Sure: {"a": 1}')
    r1 = after_reasoning(GrammarSpec.json_schema(SCHEMA), "deepseek_r1")
    assert constraint_takes(compiler, r1, 'Let me see.</think>\n{"a": 1}')
    assert not constraint_takes(compiler, r1, '{"a": 1}')  # its reasoning is open from the prompt
    for spec, answer in (
        (GrammarSpec.choice(["yes", "no"]), "no"),
        (GrammarSpec("regex", "[0-9]{3}"), "123"),
        (GrammarSpec("json_object"), '{"x": [1]}'),
        (GrammarSpec("grammar", 'root ::= "ok"'), "ok"),
        (GrammarSpec.structural_tag({"format": {"type": "const_string", "value": "hi"}}), "hi"),
    ):
        wrapped = after_reasoning(spec, "qwen3")
        assert constraint_takes(compiler, wrapped, f"<think>hmm</think> {answer}"), spec.kind
        assert not constraint_takes(compiler, wrapped, f"<think>hmm</think> x{answer}"), spec.kind


def test_the_engine_answers_in_the_form_after_its_reasoning(
    default_checkpoint_fp32: LoadedCheckpoint,
) -> None:
    """Float32, in process, greedy and sampled: the output's content (after any reasoning)
    is an object of the schema, and the request ends there."""
    llm = make_llm(default_checkpoint_fp32)
    spec = after_reasoning(GrammarSpec.json_schema(SCHEMA), "qwen3")
    for temperature in (0.0, 0.9):
        params = SamplingParams(max_tokens=60, temperature=temperature, seed=11, grammar=spec)
        (result,) = llm.generate(["Give a JSON object with a number a:"], params)
        content = split_reasoning(result.text, "qwen3").content
        assert result.finish_reason.value == "stop", result.text
        assert re.fullmatch(r"\s*\{.*\}", content, re.DOTALL), result.text
        assert isinstance(json.loads(content)["a"], int)
    assert_no_leaks(llm)


def test_the_responses_api_gives_the_reasoning_its_own_item() -> None:
    """Through the Responses builder: a ``reasoning`` item first (its text deltas joined are
    its text), then the message of the content; the usage counts the reasoning's tokens."""
    from splitserve.gateway.responses_events import ResponsesBuilder
    from splitserve.gateway.responses_schemas import ResponseObject, ResponsesRequest

    body = ResponsesRequest.model_validate({"input": "Hi"})
    body._reasoning_format = "qwen3"
    builder = ResponsesBuilder("resp_1", "m", body, None)
    pieces = ["<think>", "Greet", " back.", "</think>", "Hello", "!"]
    events = builder.opening_chunks()
    for piece in pieces:
        events += builder.add(Chunk("r", piece, (1,), (), USAGE))
    events += builder.finish(Finish("r", "stop", None, Usage(3, 6, 0)))
    whole = events[-1]["response"]
    ResponseObject.model_validate(whole)
    reasoning, message = whole["output"]
    assert reasoning["type"] == "reasoning" and message["type"] == "message"
    assert reasoning["content"][0]["text"] == "Greet back."
    assert message["content"][0]["text"] == "Hello!"
    deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == "Greet back."
    done = [e for e in events if e["type"] == "response.reasoning_text.done"]
    assert [e["text"] for e in done] == ["Greet back."]
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == 2
