"""OpenAI request and response bodies, as pydantic models (they also make the OpenAPI schema).

Requests accept the OpenAI fields splitserve implements plus vLLM's common extensions
(``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``,
``stop_token_ids``, ``skip_special_tokens``, ``add_special_tokens``, chat's ``best_of``;
``prompt_logprobs``, ``allowed_token_ids``, ``bad_words``, ``cache_salt``; explicit ``null``
means the default). Declared fields whose meaning is not implemented (``suffix``) are refused
with a 400 by ``gateway/sampling.py``; undeclared ones (``model_extra``) go through
``gateway/unserved_fields.py``: vLLM's other extensions are refused with a 400 naming them
unless they ask for nothing, anything else is ignored with a warning and a counter, as vLLM
does.

Responses are built as plain dicts on the hot path (``gateway/responses.py``); the response
models here describe those dicts for the OpenAPI schema and are checked against them in tests.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

# ---- requests -----------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool | None = True
    """Send a final chunk with ``choices: []`` and the request's ``usage`` (default on once
    ``stream_options`` is given, as in vLLM)."""
    continuous_usage_stats: bool | None = False
    """vLLM extension: every chunk also carries the usage so far."""


class _TextBody(BaseModel):
    """A body whose strings go on to the coordinator (undeclared fields kept for
    ``gateway/unserved_fields.py``)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _strings_are_unicode(cls, data: Any) -> Any:
        """JSON may escape a lone UTF-16 surrogate (``"\\ud800"``), which no UTF-8 text (the
        tokenizer's, protobuf's) can hold: refuse it here, naming where it is."""
        where = unencodable_string_path(data)
        if where is not None:
            raise ValueError(f"{where or 'body'}: a string holds a lone UTF-16 surrogate")
        return data


class _SamplingFields(_TextBody):
    """Fields shared by every generation endpoint (the Responses API overrides a few)."""

    model: str | None = Field(None, description="Served model name (see GET /v1/models).")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(
        1, ge=1, le=128, description="Choices per prompt (each sampled on its own)."
    )
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(
        None,
        description="Token id (as a string) -> bias in [-100, 100], added to that token's logit "
        "before penalties and sampling.",
    )
    user: str | None = None
    best_of: int | None = Field(
        None, ge=1, le=128,
        description="Candidates per prompt; the n with the highest cumulative logprob return "
        "(not streamed when above n).",
    )  # fmt: skip
    # vLLM extensions
    add_special_tokens: bool | None = Field(
        None,
        description="Tokenize the prompt with the tokenizer's special tokens (its BOS, where "
        "the model adds one). Default: true for completions, false for chat (the chat "
        "template writes its own).",
    )
    top_k: int | None = Field(None, description="-1 or 0 disables.")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool | None = False
    include_stop_str_in_output: bool | None = Field(
        False, description="A stop string that ends the text stays at its end."
    )
    return_tokens_as_token_ids: bool | None = Field(
        False, description="Name each token in the logprobs `token_id:<id>`, not by its text."
    )
    truncate_prompt_tokens: int | None = Field(
        None,
        ge=-1,
        le=2**31 - 1,
        description="Keep only the prompt's last N tokens (-1: as many as the context takes); "
        "without it a prompt over the context is refused.",
    )
    return_token_ids: bool | None = Field(
        False,
        description="Return the prompt's token ids (`prompt_token_ids`) and each choice's "
        "(`token_ids`; streamed, each chunk those since the last).",
    )
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = Field(
        None,
        description="The only token ids that may be generated (at least one); not with a "
        "structured output or a forced tool call.",
    )
    bad_words: list[str] | None = Field(
        None,
        description="Words never generated: each, as written at the text's start and after a "
        "space, is never completed (its last token is never sampled after the others).",
    )
    skip_special_tokens: bool | None = None
    use_beam_search: bool | None = Field(
        False,
        description="Beam search: the n best of n beams (n: the beam width, at most 10), "
        "ranked by log-probability over length ** length_penalty; no sampling fields.",
    )
    length_penalty: float | None = Field(
        None, description="Beam search's length exponent (default 1.0)."
    )
    request_id: str | None = Field(
        None,
        max_length=256,
        description="Names the request on every worker and in the response's x-request-id "
        "header (the x-request-id request header wins when both are sent).",
    )
    cache_salt: str | None = Field(
        None,
        max_length=1024,
        description="The request's prefix-cache namespace: its prompt shares cached KV only "
        "with requests of the same salt (e.g. one per tenant).",
    )
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=20,
        description="Return each prompt token's logprob after the first and this many top "
        "alternatives (vLLM's form; not streamed). The whole prompt is computed: no "
        "prefix-cache hit.",
    )
    priority: int | None = Field(
        None,
        ge=-(2**31) + 1,
        le=2**31 - 1,
        description="Admission order among waiting requests as in vLLM: lower first (default "
        "0); at least minus the API key's tenant's max_priority (the gRPC API's priority is "
        "this one negated: higher first).",
    )
    # structured outputs: OpenAI's response_format, vLLM's older guided_* and newer
    # structured_outputs (at most one of them per request)
    response_format: dict[str, Any] | None = Field(
        None,
        description="{'type': 'text' | 'json_object'}, {'type': 'json_schema', "
        "'json_schema': {'name': ..., 'schema': {...}}} or {'type': 'structural_tag', "
        "'format': {...}} (xgrammar's structural tag; vLLM's structures and triggers too).",
    )
    guided_json: dict[str, Any] | str | None = Field(None, description="A JSON schema.")
    guided_regex: str | None = Field(None, description="A regular expression.")
    guided_choice: list[str] | None = Field(None, description="One of these strings.")
    guided_grammar: str | None = Field(None, description="A Lark or GBNF grammar.")
    structured_outputs: dict[str, Any] | None = Field(
        None,
        description="vLLM's: exactly one of json (a schema), regex, choice, grammar, "
        "json_object (true), structural_tag (its JSON text).",
    )
    # splitserve extensions
    ttft_slo_ms: float | None = Field(
        None,
        gt=0.0,
        allow_inf_nan=False,
        description="This request's time-to-first-token target in ms, for where its prompt is "
        "computed (adaptive placement); default: the coordinator's --ttft-slo-ms.",
    )
    max_queue_wait_ms: float | None = Field(
        None,
        gt=0.0,
        allow_inf_nan=False,
        description="The longest this request may wait for admission; one predicted to wait "
        "longer, or that waited that long, gets 429 with Retry-After. Default: the "
        "coordinator's --max-queue-wait.",
    )
    tpot_slo_ms: float | None = Field(
        None,
        gt=0.0,
        allow_inf_nan=False,
        description="This request's time-per-output-token target in ms; it can only tighten "
        "the coordinator's --tpot-slo-ms, which guards the decode batch it joins.",
    )


def unencodable_string_path(data: Any) -> str | None:
    """The dotted path (``messages.0.content``; "" for ``data`` itself) of the first string in
    a parsed JSON value that is not encodable as UTF-8, or None. Walks iteratively: a
    deeply nested body cannot exhaust the stack."""
    pending: list[tuple[str, Any]] = [("", data)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(value, dict):
            for key, item in value.items():
                name = f"{path}.{key}" if path else str(key)
                pending.append((name, key))
                pending.append((name, item))
        elif isinstance(value, list):
            pending.extend((f"{path}.{i}" if path else str(i), v) for i, v in enumerate(value))
    return None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="Text, token ids, or a list of either (choices in prompt order)."
    )
    logprobs: int | None = Field(
        None, ge=0, le=20, description="Return this many top alternatives per token."
    )
    echo: bool | None = Field(
        False,
        description="Return the prompt before the completion; with logprobs, the prompt's "
        "tokens lead the logprobs (the first with null logprob and top_logprobs).",
    )
    suffix: str | None = None


class CalledFunction(BaseModel):
    name: str
    arguments: str | dict[str, Any] = Field(
        "{}", description="JSON text (OpenAI's), or the JSON object itself."
    )


class MessageToolCall(BaseModel):
    """One call of an assistant message's ``tool_calls``."""

    id: str = ""
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = Field(
        None, description="Text, or a list of {'type': 'text', 'text': ...} parts."
    )
    tool_calls: list[MessageToolCall] | None = Field(
        None,
        description="An assistant message's tool calls, shown to the chat template "
        "(common/chat_messages.py).",
    )
    tool_call_id: str | None = Field(
        None, description="The call a tool message answers, shown to the chat template."
    )


class _ChatTemplateFields(BaseModel):
    """How the model's chat template renders the messages (vLLM's fields)."""

    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="More variables for the chat template, e.g. {'enable_thinking': false}; "
        "none the template is given anyway (messages, add_generation_prompt, ...).",
    )
    add_generation_prompt: bool | None = Field(
        True, description="The template's generation prompt closes the text (default true)."
    )
    continue_final_message: bool | None = Field(
        False,
        description="The text ends with the final message's content, an assistant's, for the "
        "model to go on (needs add_generation_prompt: false).",
    )
    documents: list[dict[str, str]] | None = Field(
        None,
        description="Documents for a retrieval-augmented chat template (vLLM's; e.g. Command "
        "R's or Granite's), each a mapping of strings such as {'title', 'text'}, given to the "
        "template as `documents`. A 400 where the model's template reads none.",
    )
    reasoning_effort: Literal["low", "medium", "high"] | None = Field(
        None,
        description="How much a reasoning model reasons (OpenAI's; as vLLM, given to the "
        "chat template as `reasoning_effort`, e.g. gpt-oss's). A 400 where the model's "
        "template reads none.",
    )
    chat_template: str | None = Field(
        None,
        description="A chat template of the request's own (Jinja), used instead of the "
        "model's (vLLM's); a 400 unless the coordinator runs with "
        "--trust-request-chat-template.",
    )


class ChatCompletionRequest(_ChatTemplateFields, _SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="Alias of max_tokens.")
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = Field(
        None, description="Function tools, described to the model (client/tools.py)."
    )
    tool_choice: str | dict[str, Any] | None = Field(
        None, description="none, auto (default with tools), required or a named function."
    )
    parallel_tool_calls: bool | None = Field(
        None, description="With tool_choice required: several calls in one answer (default)."
    )
    _tool_format: str = PrivateAttr("json")
    """How the served model calls tools (its ``ModelInfo.tool_call_format``), set by the route
    once it knows the model (``gateway/sampling.py:serve_model_formats``)."""
    _reasoning_format: str = PrivateAttr("")
    """How its answers hold their reasoning (``ModelInfo.reasoning_format``; "" none), set so."""
    include_reasoning: bool | None = Field(
        True,
        description="vLLM's: with a reasoning model (the coordinator's --reasoning-parser), "
        "return its reasoning as reasoning_content (default true; false leaves it out).",
    )
    echo: bool | None = Field(
        False,
        description="vLLM's: the answer's content begins with the last message's content where "
        "that message is the answer's own role (an assistant's; with add_generation_prompt: "
        "false, whichever), as continue_final_message continues it.",
    )


# ---- responses ----------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """One token of a prompt position (vLLM's ``prompt_logprobs`` entries)."""

    logprob: float
    rank: int = Field(description="1 + the number of tokens more likely here.")
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]
"""vLLM's ``prompt_logprobs``: null for the first prompt token, then per prompt token its
own entry and the top alternatives, keyed by token id (a string)."""


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: str | int | None = Field(
        None, description="The stop string or token id that ended the text (vLLM extension)."
    )
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = Field(None, description="With `return_token_ids`.")
    token_ids: list[int] | None = Field(
        None, description="With `return_token_ids`; streamed, those since the last chunk."
    )


class CompletionResponse(BaseModel):
    """A completion; streamed as ``text/event-stream`` chunks of the same shape with
    ``object: "text_completion"`` (the last one may have ``choices: []`` and ``usage``)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ResponseFunction(BaseModel):
    name: str
    arguments: str
    """The JSON text the model wrote."""


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunction


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = Field(
        None, description="A reasoning model's reasoning (the coordinator's --reasoning-parser)."
    )
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = Field(None, description="With `return_token_ids`.")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = Field(None, description="With `return_token_ids`.")


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call: the first of a call has its ``id``, ``type`` and
    ``function.name``; the later ones only ``index`` and the next ``function.arguments``."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = Field(
        None, description="With `return_token_ids`: those since the last chunk."
    )


class ChatCompletionChunk(BaseModel):
    """One ``data:`` event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = Field(
        None, description="With `return_token_ids`, on the first chunk."
    )


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "splitserve"
    max_model_len: int
    root: str | None = Field(None, description="A LoRA adapter's own name (vLLM's).")
    parent: str | None = Field(
        None, description="A LoRA adapter's base model (vLLM's); null for a base model."
    )


class TokenizeRequest(_ChatTemplateFields, _TextBody):
    """``POST /tokenize`` (vLLM's): exactly one of ``prompt`` or ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = Field(
        None,
        description="As in a generation request: default true for prompt, false for messages.",
    )
    tools: list[dict[str, Any]] | None = Field(
        None,
        description="With messages: the tools shown as a chat completion shows them (the "
        "served model's format), so the count holds them.",
    )


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: None = None


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int] = Field(..., description="Token ids; special tokens are kept in the text.")


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody


class LoadLoraAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's): serve the adapter in ``lora_path`` as
    ``lora_name`` on every worker of the model."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(..., description="The name requests will use as their `model`.")
    lora_path: str = Field(
        ...,
        description="The adapter's folder (PEFT's saved format) on the workers: relative to "
        "their --lora-dir, or absolute within it.",
    )
    load_inplace: bool = Field(
        False,
        description="Where `lora_name` is served with other files, replace them: every worker "
        "checks the new files first, then all serve them to the requests that come next "
        "(requests running finish with the old files). Without it, that is a 400.",
    )
    model: str | None = Field(
        None,
        description="splitserve's: the base model whose workers load it, where the gateway "
        "serves several (default: its first).",
    )


class UnloadLoraAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's): stop serving ``lora_name``."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: int | None = Field(
        None, description="vLLM's; accepted and unused (adapters are named, not numbered)."
    )
