"""OpenAI request bodies -> the coordinator's prompt and sampling parameters.

Contract: everything a request asks for is either honoured or refused with a 400 naming the
field; nothing is dropped silently. Defaults follow vLLM's OpenAI server: a completion without
``max_tokens`` gets 16 tokens, a chat completion without it may fill the context window.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel

from splitserve.client import ChatMessage, ChatTemplate, ModelInfo, Sampling, ToolCall
from splitserve.client.reasoning import after_reasoning
from splitserve.client.tools import ToolPlan, tool_plan, with_template_tools, with_tools
from splitserve.common.errors import InvalidRequestError
from splitserve.common.grammar import GrammarSpec
from splitserve.gateway import schemas
from splitserve.gateway.errors import invalid
from splitserve.gateway.responses_schemas import ResponsesRequest
from splitserve.gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    _ChatTemplateFields,
    _SamplingFields,
)

COMPLETION_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class PromptArgs:
    """Exactly one of the three is set (the client's ``stream`` keyword arguments)."""

    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    token_ids: tuple[int, ...] | None = None
    chat_template: ChatTemplate | None = None
    """How ``messages`` are rendered; None: the template's defaults."""


def check_wire_token_ids(token_ids: Iterable[int], what: str, param: str) -> None:
    """400 naming ``param`` unless every id is one the wire carries (int32, never negative)."""
    if any(not 0 <= token < 2**31 for token in token_ids):
        raise invalid(f"{what} must be in [0, 2^31)", param)


MAX_CHOICES = 128
"""Most choices one request may ask for (prompts x ``n``)."""


def completion_prompts(body: CompletionRequest) -> list[PromptArgs]:
    """The request's prompts in order: text, token ids, or a list of either (one choice
    index block per prompt, as in OpenAI's API)."""
    prompt = body.prompt
    check_wire_token_ids(_token_ids_in(prompt), "prompt token ids", "prompt")
    if isinstance(prompt, str):
        return [PromptArgs(prompt=prompt)]
    if not prompt:
        raise invalid("prompt must not be empty", "prompt")
    if all(isinstance(item, int) for item in prompt):
        return [PromptArgs(token_ids=tuple(prompt))]  # type: ignore[arg-type]
    prompts = []
    for item in prompt:
        if isinstance(item, str):
            prompts.append(PromptArgs(prompt=item))
        elif not item:
            raise invalid("prompt must not hold an empty list of token ids", "prompt")
        else:
            prompts.append(PromptArgs(token_ids=tuple(item)))  # type: ignore[arg-type]
    return prompts


def _token_ids_in(prompt: str | list[str] | list[int] | list[list[int]]) -> list[int]:
    """Every token id in a completions prompt (none for text)."""
    if isinstance(prompt, str):
        return []
    ids: list[int] = []
    for item in prompt:
        if isinstance(item, int):
            ids.append(item)
        elif isinstance(item, list):
            ids.extend(item)
    return ids


def serve_model_formats(body: BaseModel, info: ModelInfo) -> None:
    """Tell a chat or Responses ``body`` how its model calls tools and holds its reasoning
    (``ModelInfo``'s ``tool_call_format`` and ``reasoning_format``), before its prompts,
    sampling and builders are read from it."""
    bodies: list[ChatCompletionRequest | ResponsesRequest] = []
    if isinstance(body, ChatCompletionRequest):
        bodies.append(body)
    elif isinstance(body, ResponsesRequest):
        bodies.append(body)
        if body._chat is not None:
            bodies.append(body._chat)
    for each in bodies:
        each._tool_format = info.tool_call_format
        each._reasoning_format = info.reasoning_format


def tokenized_tools(
    messages: tuple[ChatMessage, ...],
    template: ChatTemplate | None,
    tools: list[dict[str, Any]],
    tool_format: str,
) -> tuple[tuple[ChatMessage, ...], ChatTemplate | None]:
    """A ``/tokenize`` chat's messages and template with its ``tools`` shown as a chat
    completion of the model would show them (``tool_choice`` auto); 400 naming the field for
    malformed tools, or tools set in ``chat_template_kwargs`` too."""
    try:
        plan = tool_plan(tools, None, None, tool_format)
        return tuple(with_tools(messages, plan)), with_template_tools(template, plan)
    except InvalidRequestError as error:
        raise invalid(error.message, error.param) from None


def chat_prompts(body: ChatCompletionRequest) -> list[PromptArgs]:
    """The messages, with the request's tools shown as its model's format shows them: in
    the system message, or among the chat template's variables (``client/tools.py``)."""
    plan = request_tools(body)
    messages = with_tools(chat_messages(body.messages), plan)
    try:
        template = with_template_tools(chat_template_of(body), plan)
    except InvalidRequestError as error:
        raise invalid(error.message, error.param) from None
    return [PromptArgs(messages=tuple(messages), chat_template=template)]


def asked_template_fields(body: _ChatTemplateFields) -> list[tuple[str, bool]]:
    """Each field that says how messages are rendered, and whether it asks for anything
    other than the template's default."""
    return [
        ("chat_template_kwargs", bool(body.chat_template_kwargs)),
        ("add_generation_prompt", body.add_generation_prompt is False),
        ("continue_final_message", bool(body.continue_final_message)),
        ("documents", bool(body.documents)),
        ("reasoning_effort", body.reasoning_effort is not None),
        ("chat_template", bool(body.chat_template)),
    ]


def chat_template_of(body: _ChatTemplateFields) -> ChatTemplate | None:
    """How the body asks its messages to be rendered; None for the template's defaults
    (``asked_template_fields`` asks nothing). The coordinator refuses what cannot be rendered
    so (a 400 naming the field)."""
    if not any(asked for _, asked in asked_template_fields(body)):
        return None
    kwargs = dict(body.chat_template_kwargs or {})
    if body.documents:
        if "documents" in kwargs:
            raise invalid(
                "documents are given twice: as documents and in chat_template_kwargs", "documents"
            )
        kwargs["documents"] = body.documents
    if body.reasoning_effort is not None:
        if "reasoning_effort" in kwargs:
            raise invalid(
                "reasoning_effort is given twice: as reasoning_effort and in chat_template_kwargs",
                "reasoning_effort",
            )
        kwargs["reasoning_effort"] = body.reasoning_effort
    return ChatTemplate(
        kwargs,
        body.add_generation_prompt is not False,
        bool(body.continue_final_message),
        body.chat_template or None,
    )


def request_tools(body: ChatCompletionRequest) -> ToolPlan | None:
    """The body's ``ToolPlan`` (``client/tools.py``); 400 naming the field for malformed
    tools or choices."""
    try:
        return tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls, body._tool_format)
    except InvalidRequestError as error:
        raise invalid(error.message, error.param) from None


def chat_messages(given: Sequence[schemas.ChatMessage]) -> tuple[ChatMessage, ...]:
    """The client's messages of a request body (text parts joined; other parts: 400), with
    their tool call ids and calls (the coordinator shows them to the chat template:
    ``common/chat_messages.py``)."""
    messages = []
    for index, message in enumerate(given):
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise invalid(
                        "only text content parts are supported", f"messages.{index}.content"
                    )
                texts.append(part["text"])
            content = "".join(texts)
        if message.tool_calls and message.role != "assistant":
            raise invalid("only assistant messages make tool calls", f"messages.{index}")
        calls = tuple(_history_call(call) for call in message.tool_calls or ())
        messages.append(ChatMessage(message.role, content or "", message.tool_call_id or "", calls))
    return tuple(messages)


def chat_echo(body: ChatCompletionRequest) -> str:
    """What a chat answer's content begins with (vLLM's ``echo``): the last message's content
    where it is the answer's role (an assistant's; without the generation prompt the answer
    continues the last message, whatever its role); else nothing."""
    if not body.echo:
        return ""
    (last,) = chat_messages(body.messages[-1:])
    if body.add_generation_prompt is not False and last.role != "assistant":
        return ""
    return last.content


def _history_call(call: schemas.MessageToolCall) -> ToolCall:
    arguments = call.function.arguments
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ToolCall(call.function.name, text, call.id)


def completion_sampling(body: CompletionRequest) -> Sampling:
    if body.suffix:
        raise invalid("suffix is not supported", "suffix")
    max_tokens = body.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS
    sampling = _sampling(body, max_tokens, _ranking_logprobs(body, body.logprobs))
    if wants_echo_logprobs(body):  # the prompt's tokens lead the logprobs
        asked = max(body.logprobs, sampling.prompt_logprobs or 0)
        sampling = replace(sampling, prompt_logprobs=asked)
    return sampling


def wants_echo_logprobs(body: CompletionRequest) -> bool:
    """Whether a completions body asks for the prompt's tokens in its logprobs (``echo``
    with ``logprobs``)."""
    return bool(body.echo) and body.logprobs is not None


def best_of_asked(body: _SamplingFields) -> int | None:
    """``best_of`` when it asks for more candidates than ``n``, else None; 400 naming it
    when it asks for fewer, or for more while streaming (the best are known at the end)."""
    best_of, n = body.best_of, body.n or 1
    if best_of is None:
        return None
    if best_of < n:
        raise invalid("best_of must be at least n", "best_of")
    if best_of == n:
        return None
    if body.stream:
        raise invalid("best_of above n cannot be streamed", "best_of")
    return best_of


def _ranking_logprobs(body: _SamplingFields, logprobs: int | None) -> int | None:
    """The logprobs to ask for: with ``best_of``, at least the sampled tokens' (they rank
    the candidates, ``gateway/choices.py``; returned only when the request asked)."""
    if best_of_asked(body) is not None and logprobs is None:
        return 0
    return logprobs


def chat_sampling(body: ChatCompletionRequest) -> Sampling:
    """The chat body's sampling, a forced tool call's grammar included; with a reasoning
    model, its constraint applies after the reasoning (``client/reasoning.py``)."""
    sampling = _chat_sampling(body)
    if body._reasoning_format and sampling.grammar is not None:
        try:
            grammar = after_reasoning(sampling.grammar, body._reasoning_format)
        except InvalidRequestError as error:
            raise invalid(error.message, error.param) from None
        return replace(sampling, grammar=grammar)
    return sampling


def _chat_sampling(body: ChatCompletionRequest) -> Sampling:
    if body.top_logprobs and not body.logprobs:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    both = body.max_tokens and body.max_completion_tokens
    if both and body.max_tokens != body.max_completion_tokens:
        raise invalid(
            "max_tokens and max_completion_tokens differ; send one", "max_completion_tokens"
        )
    max_tokens = body.max_completion_tokens or body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    sampling = _sampling(body, max_tokens, _ranking_logprobs(body, logprobs))
    plan = request_tools(body)
    tools_grammar = None if plan is None else plan.grammar()
    if tools_grammar is None:
        return sampling
    if sampling.grammar is not None:
        raise invalid("a forced tool call and a structured output exclude each other",
                      "tool_choice")  # fmt: skip
    return replace(sampling, grammar=tools_grammar)


def _sampling(body: _SamplingFields, max_tokens: int | None, logprobs: int | None) -> Sampling:
    if body.prompt_logprobs is not None and body.stream:
        raise invalid("prompt_logprobs are not available when streaming", "prompt_logprobs")
    if body.truncate_prompt_tokens == 0:  # the schema bounds it below by -1
        raise invalid(
            "truncate_prompt_tokens must be at least 1, or -1 for the context's length",
            "truncate_prompt_tokens",
        )
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    top_k = body.top_k
    if top_k is not None and top_k <= 0:  # vLLM: -1 (or 0) disables top-k
        top_k = None
    return Sampling(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=top_k,
        min_p=body.min_p,
        seed=None if body.seed is None else body.seed % 2**63,  # OpenAI seeds may be < 0
        repetition_penalty=body.repetition_penalty,
        frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
        stop=tuple(s for s in stop if s),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=bool(body.ignore_eos),
        include_stop_str_in_output=bool(body.include_stop_str_in_output),
        min_tokens=body.min_tokens,
        logprobs=logprobs,
        skip_special_tokens=body.skip_special_tokens,
        logit_bias=_logit_bias(body.logit_bias),
        allowed_token_ids=None if body.allowed_token_ids is None else tuple(body.allowed_token_ids),
        bad_words=tuple(body.bad_words or ()),
        cache_salt=body.cache_salt or None,
        grammar=grammar_of(body),
        prompt_logprobs=body.prompt_logprobs,
    )


def grammar_of(body: _SamplingFields) -> GrammarSpec | None:
    """The request's structured output, from whichever one field asks for it (OpenAI's
    ``response_format``, vLLM's ``guided_*`` or ``structured_outputs``); 400 naming the field
    for a malformed one or for two at once. Whether it compiles is the coordinator's check."""
    asked: list[tuple[str, GrammarSpec]] = []
    if body.response_format is not None:
        spec = _response_format(body.response_format)
        if spec is not None:
            asked.append(("response_format", spec))
    if body.guided_json is not None:
        asked.append(("guided_json", GrammarSpec.json_schema(body.guided_json)))
    if body.guided_regex is not None:
        asked.append(("guided_regex", GrammarSpec("regex", body.guided_regex)))
    if body.guided_choice is not None:
        asked.append(
            ("guided_choice", _spec("guided_choice", GrammarSpec.choice, body.guided_choice))
        )
    if body.guided_grammar is not None:
        asked.append(("guided_grammar", GrammarSpec("grammar", body.guided_grammar)))
    if body.structured_outputs is not None:
        asked.append(("structured_outputs", _structured_outputs(body.structured_outputs)))
    if len(asked) > 1:
        raise invalid(
            f"ask for one structured output, not {len(asked)} ({', '.join(f for f, _ in asked)})",
            asked[1][0],
        )
    return asked[0][1] if asked else None


def _spec(field: str, make: Callable[[Any], GrammarSpec], value: Any) -> GrammarSpec:
    try:
        return make(value)
    except InvalidRequestError as error:
        raise invalid(error.message, field) from None


def _response_format(value: dict[str, Any]) -> GrammarSpec | None:
    kind = value.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        schema = (value.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise invalid("response_format json_schema needs json_schema.schema, an object",
                          "response_format")  # fmt: skip
        return GrammarSpec.json_schema(schema)
    if kind == "structural_tag":
        return _spec("response_format", GrammarSpec.structural_tag, value)
    raise invalid(f"unknown response_format type {kind!r}", "response_format")


def _structured_outputs(value: dict[str, Any]) -> GrammarSpec:
    given = {key: item for key, item in value.items() if item is not None and item is not False}
    given.pop("disable_fallback", None)
    given.pop("disable_any_whitespace", None)
    if len(given) != 1:
        raise invalid("structured_outputs takes exactly one of json, regex, choice, grammar, "
                      "json_object, structural_tag", "structured_outputs")  # fmt: skip
    ((key, item),) = given.items()
    if key == "json" and isinstance(item, dict | str):
        return GrammarSpec.json_schema(item)
    if key == "regex" and isinstance(item, str):
        return GrammarSpec("regex", item)
    if key == "choice" and isinstance(item, list):
        return _spec("structured_outputs", GrammarSpec.choice, item)
    if key == "grammar" and isinstance(item, str):
        return GrammarSpec("grammar", item)
    if key == "json_object" and item is True:
        return GrammarSpec("json_object")
    if key == "structural_tag" and isinstance(item, str | dict):
        return _spec("structured_outputs", GrammarSpec.structural_tag, item)
    raise invalid(f"structured_outputs.{key} is not supported in this form", "structured_outputs")


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` keys are token ids as JSON strings; values are checked (range,
    finite) and ids against the vocabulary by the coordinator."""
    if not bias:
        return None
    try:
        return {int(token_id): value for token_id, value in bias.items()}
    except ValueError:
        raise invalid("logit_bias keys must be token ids", "logit_bias") from None
