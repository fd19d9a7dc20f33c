"""OpenAI's Responses API bodies (``POST /v1/responses``) as pydantic models: the request, and
the response object for the OpenAPI schema (the gateway builds it as a plain dict:
``gateway/responses_events.py``; tests check the dicts against these models).

The request takes the Responses fields splitserve serves (``input`` as text or a list of
messages and function-call items, ``instructions``, ``max_output_tokens``, ``temperature``,
``top_p``, function ``tools``, ``tool_choice``, ``parallel_tool_calls``, ``text.format``,
``stream``, ``store`` and ``previous_response_id``: ``gateway/stored_responses.py``,
``background``: ``gateway/background.py``, ``reasoning.effort``) and, as vLLM does, the
sampling extensions every generation request has (``gateway/schemas.py:_SamplingFields``:
``top_k``, ``min_p``, ``seed``, penalties, ``stop``, latency targets, ...). A
``conversation`` is ``gateway/conversations.py``'s. Declared fields
that ask for what splitserve does not do (reasoning summaries,
``include``d extras, automatic truncation) are refused with a 400 naming them by
``gateway/responses_input.py``; of ``include`` only the output text's logprobs are served;
``n`` and ``best_of`` above 1 fail validation (a response has one output).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, PrivateAttr

from splitserve.gateway.conversations import StoredConversation
from splitserve.gateway.schemas import ChatCompletionRequest, _SamplingFields
from splitserve.gateway.stored_responses import StoredResponse

# ---- request ------------------------------------------------------------------------------


class ResponsesRequest(_SamplingFields):
    """``POST /v1/responses``."""

    input: str | list[dict[str, Any]] = Field(
        ...,
        description="Text (one user message), or a list of items: messages ({'role': 'user' | "
        "'system' | 'developer' | 'assistant', 'content': text or input_text / output_text "
        "parts}), and a tool round's 'function_call' and 'function_call_output' items.",
    )
    instructions: str | None = Field(None, description="A system message before the input.")
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = Field(
        None,
        description="Function tools ({'type': 'function', 'name', 'description', "
        "'parameters'}), described to the model (client/tools.py).",
    )
    tool_choice: str | dict[str, Any] | None = Field(
        None, description="none, auto (default with tools), required or {'type': 'function', "
        "'name': ...}."
    )  # fmt: skip
    parallel_tool_calls: bool | None = Field(
        None, description="With tool_choice required: several calls in one answer (default)."
    )
    text: dict[str, Any] | None = Field(
        None,
        description="{'format': {'type': 'text' | 'json_object'}} or {'format': {'type': "
        "'json_schema', 'name': ..., 'schema': {...}}}: a structured output.",
    )
    store: bool | None = Field(
        None,
        description="Keep the response (default: yes, unless the gateway runs with "
        "--response-store none) for previous_response_id, GET /v1/responses/{id} and its "
        "input_items, for --response-store-ttl seconds.",
    )
    previous_response_id: str | None = Field(
        None,
        description="Continue that stored response's conversation: its input and output "
        "come before this input (its instructions do not).",
    )
    stream_options: dict[str, Any] | None = Field(
        None, description="Accepted; no obfuscation padding is sent either way."
    )
    n: int | None = Field(1, ge=1, le=1, description="A response has one output.")
    best_of: int | None = Field(None, ge=1, le=1, description="A response has one output.")
    metadata: dict[str, Any] | None = Field(
        None,
        description="Kept with the response and returned in it (at most 16 pairs of strings, "
        "keys up to 64 characters, values 512).",
    )
    conversation: str | dict[str, Any] | None = Field(
        None,
        description="A conversation's id (or {'id': ...}, gateway/conversations.py): its items "
        "come before this input, and this input and the output are added to it once the "
        "response ended (completed or incomplete). Not with previous_response_id.",
    )
    # refused unless they ask for nothing (gateway/responses_input.py)
    include: list[str] | None = Field(
        None, description="Only 'message.output_text.logprobs': each output token's logprob."
    )
    top_logprobs: int | None = Field(
        None, ge=0, le=20, description="With that include: this many alternatives per token."
    )
    reasoning: dict[str, Any] | None = Field(
        None,
        description="{'effort': 'low' | 'medium' | 'high'}: the chat template's "
        "reasoning_effort (a 400 where the template reads none); summaries are not served.",
    )
    background: bool | None = Field(
        None,
        description="Run it apart from this request: answered at once 'queued' (or streamed "
        "as it runs), polled with GET /v1/responses/{id}, cancelled with POST "
        "/v1/responses/{id}/cancel; must be stored.",
    )
    truncation: str | None = None
    max_tool_calls: int | None = None
    prompt: dict[str, Any] | None = None
    _tool_format: str = PrivateAttr("json")
    """As ``ChatCompletionRequest``'s: passed on to the chat it amounts to."""
    _reasoning_format: str = PrivateAttr("")
    """As ``ChatCompletionRequest``'s: passed on to the chat it amounts to."""
    _previous: StoredResponse | None = PrivateAttr(None)
    """The stored response ``previous_response_id`` names, read before the prompt
    (``gateway/app.py:_generate``)."""
    _conversation: StoredConversation | None = PrivateAttr(None)
    """The conversation ``conversation`` names, read before the prompt."""
    _stored: bool = PrivateAttr(False)
    """Whether this response is stored (``gateway/stored_responses.py:StoredResponses.stores``)."""
    _chat: ChatCompletionRequest | None = PrivateAttr(None)
    """The chat completion this request amounts to, once ``gateway/responses_input.py:as_chat``
    made it (its prompt, sampling and builder each ask for it)."""


# ---- response -----------------------------------------------------------------------------


class TokenAlternative(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TokenAlternative):
    top_logprobs: list[TokenAlternative]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any]
    logprobs: list[TokenLogprob] | None = Field(
        None, description="Each token's, when include asks for 'message.output_text.logprobs'."
    )


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    """The JSON text the model wrote."""
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """A reasoning model's reasoning (the coordinator's ``--reasoning-parser``)."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any]
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """A response; streamed as typed SSE events (``event: response.created``, ...,
    ``response.output_text.delta``, ..., ``response.completed``), each with a
    ``sequence_number``."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    completed_at: int | None
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[ReasoningItem | OutputMessage | FunctionCallItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    metadata: dict[str, str]
    background: bool
    store: bool
    temperature: float | None
    top_p: float | None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    truncation: Literal["disabled"]
    usage: ResponseUsage | None


class ResponseDeleted(BaseModel):
    """``DELETE /v1/responses/{response_id}``."""

    id: str
    object: Literal["response"] = "response"
    deleted: bool


class InputItemList(BaseModel):
    """``GET /v1/responses/{response_id}/input_items``: a page of the items the response
    answered (its conversation's, a ``previous_response_id``'s included), each with an id."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
