"""The client's values: what goes into a request and what comes out of a stream (torch-free).

Frozen dataclasses, independent of the generated proto classes except for
``Sampling.to_proto`` and ``LatencyTargets.to_proto``; ``splitserve.client.wire`` converts
responses into them. Chat messages and tool calls (``ChatMessage``, ``ToolCall``) are the
ones every layer carries, ``common/chat_messages.py``'s, exported here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from dataclasses import field as dataclass_field
from typing import Any

import grpc

from splitserve.client.errors import ClientError
from splitserve.common.chat_messages import ChatMessage as ChatMessage  # the client's too
from splitserve.common.chat_messages import ToolCall
from splitserve.common.grammar import GrammarSpec
from splitserve.proto.splitserve.v1 import common_pb2, coordinator_pb2

_REPEATED_SAMPLING_FIELDS = ("stop", "stop_token_ids", "bad_words")


@dataclass(frozen=True)
class LatencyTargets:
    """A request's own latency targets, milliseconds, for where its prompt is computed (the
    coordinator's adaptive placement); mirrors ``coordinator_pb2.LatencyTargets``. None takes
    the coordinator's target; the TPOT target can only tighten it (it guards the whole decode
    batch the request joins). None or 0 asks for the coordinator's; the server refuses a
    negative or non-finite target with INVALID_ARGUMENT."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    max_queue_wait_ms: float | None = None
    """The longest the request may wait for admission before it is refused (429 /
    RESOURCE_EXHAUSTED with a retry hint); None: the coordinator's ``--max-queue-wait``."""

    def to_proto(self) -> coordinator_pb2.LatencyTargets:
        return coordinator_pb2.LatencyTargets(
            ttft_ms=0.0 if self.ttft_ms is None else self.ttft_ms,
            tpot_ms=0.0 if self.tpot_ms is None else self.tpot_ms,
            max_queue_wait_ms=0.0 if self.max_queue_wait_ms is None else self.max_queue_wait_ms,
        )


@dataclass(frozen=True)
class ChatTemplate:
    """How the model's chat template renders a request's messages (vLLM's fields).

    ``kwargs``: more variables the template sees (JSON values, e.g. ``{"enable_thinking":
    False}``); ``add_generation_prompt``: the template's generation prompt closes the text;
    ``continue_final_message``: the text ends with the final message's content, an
    assistant's, for the model to go on (``add_generation_prompt`` must then be False);
    ``source``: a template of the request's own (Jinja text) used instead of the model's, taken
    only by a coordinator run with ``--trust-request-chat-template``."""

    kwargs: Mapping[str, Any] = dataclass_field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    source: str | None = None

    def to_proto(self, messages: list[coordinator_pb2.ChatMessage]) -> coordinator_pb2.ChatPrompt:
        """The chat prompt of ``messages`` rendered so."""
        return coordinator_pb2.ChatPrompt(
            messages=messages,
            template_kwargs_json=json.dumps(dict(self.kwargs)) if self.kwargs else "",
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            template=self.source or "",
        )


@dataclass(frozen=True)
class Sampling:
    """How to pick each token and when to stop; mirrors ``common_pb2.SamplingParams``.

    Every field left at None takes the server's default (vLLM / OpenAI semantics); values are
    validated by the server, which answers INVALID_ARGUMENT naming the field.
    """

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    """A stop string that ends the text stays at its end."""
    min_tokens: int | None = None
    logprobs: int | None = None
    """Return each sampled token's logprob and this many top alternatives (0..20)."""
    skip_special_tokens: bool | None = None
    logit_bias: Mapping[int, float] | None = None
    """Token id -> bias in [-100, 100], added to that token's logit before sampling."""
    grammar: GrammarSpec | None = None
    """Structured output: the tokens must match this JSON schema, regex, choice, grammar or
    structural tag."""
    prompt_logprobs: int | None = None
    """Return each prompt token's logprob after the first and this many top alternatives
    (0..20), on the first chunk (``Chunk.prompt_logprobs``). The whole prompt is computed:
    no prefix-cache hit."""
    allowed_token_ids: tuple[int, ...] | None = None
    """The only tokens that may be generated (at least one; no grammar beside them)."""
    bad_words: tuple[str, ...] = ()
    """Words never generated (as written at the text's start and after a space)."""
    cache_salt: str | None = None
    """The request's prefix-cache namespace: it shares cached prefixes only with requests of
    the same salt."""

    def to_proto(self) -> common_pb2.SamplingParams:
        """The wire message, unset fields left unset.

        Raises ``ClientError`` (INVALID_ARGUMENT, ``param`` = the field) for a value the wire
        cannot carry (e.g. a negative ``max_tokens`` or ``seed``, which are unsigned there).
        """
        message = common_pb2.SamplingParams(
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )
        for field in fields(self):
            value = getattr(self, field.name)
            if value is None or field.name in ("ignore_eos", "include_stop_str_in_output"):
                continue
            try:
                if field.name in _REPEATED_SAMPLING_FIELDS:
                    getattr(message, field.name).extend(value)
                elif field.name == "logit_bias":
                    message.logit_bias.update(value)
                elif field.name == "allowed_token_ids":
                    message.allowed_token_ids.ids.extend(value)
                elif field.name == "grammar":
                    message.grammar.kind, message.grammar.text = value.kind, value.text
                else:
                    setattr(message, field.name, value)
            except (TypeError, ValueError) as error:
                raise ClientError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"invalid {field.name} {value!r}: {error}",
                    param=field.name,
                ) from error
        return message


@dataclass(frozen=True)
class Usage:
    """Token counts of a request so far (cumulative on every chunk)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    """Prompt tokens served from a prefix cache."""


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float
    text: str


@dataclass(frozen=True)
class TokenLogprob:
    """Logprob information of one generated position."""

    token_id: int
    logprob: float
    rank: int
    """1 + the number of tokens strictly more likely than the sampled one."""
    text: str
    top: tuple[TopLogprob, ...]


@dataclass(frozen=True)
class PromptToken:
    """A prompt token without a logprob: the prompt's first (nothing comes before it)."""

    token_id: int
    text: str


@dataclass(frozen=True)
class Chunk:
    """A piece of the stream: new tokens and their text delta (never broken UTF-8, never a
    partial stop string; ``text`` may be empty while tokens are held back)."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    usage: Usage
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    """On the first chunk, when asked: one record per prompt token after the first (record
    ``i`` describes prompt token ``i + 1``; its ``text`` is that token's)."""
    prompt_first_token: PromptToken | None = None
    """Beside ``prompt_logprobs``: the prompt's first token."""


@dataclass(frozen=True)
class Finish:
    """The end of a stream. ``finish_reason``: "stop" (EOS, stop token or stop string),
    "length" (max_tokens or context window) or "abort" (cancelled by ``abort()`` or an
    operator); ``stop_reason``: the stop string (str) or stop token id (int) that matched."""

    request_id: str
    finish_reason: str
    stop_reason: str | int | None
    usage: Usage


@dataclass(frozen=True)
class Generation:
    """A whole completion: every chunk of a stream joined, and how it finished."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str
    stop_reason: str | int | None
    usage: Usage
    tool_calls: tuple[ToolCall, ...] = ()
    """The calls the answer makes, when it was asked with ``tools`` (finish reason
    ``tool_calls``)."""
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    """When asked: one record per prompt token after the first (``Chunk.prompt_logprobs``)."""
    prompt_first_token: PromptToken | None = None
    reasoning: str | None = None
    """A reasoning model's reasoning (``ModelInfo.reasoning_format``): the part of ``text``
    before ``</think>``, tags left out; None where it wrote none or the model has none.
    ``text`` stays the whole answer as written."""

    @classmethod
    def of(cls, chunks: Sequence[Chunk], finish: Finish) -> Generation:
        return cls(
            request_id=finish.request_id,
            text="".join(chunk.text for chunk in chunks),
            token_ids=tuple(token for chunk in chunks for token in chunk.token_ids),
            logprobs=tuple(logprob for chunk in chunks for logprob in chunk.logprobs),
            finish_reason=finish.finish_reason,
            stop_reason=finish.stop_reason,
            usage=finish.usage,
            prompt_logprobs=next(
                (chunk.prompt_logprobs for chunk in chunks if chunk.prompt_logprobs), ()
            ),
            prompt_first_token=next(
                (chunk.prompt_first_token for chunk in chunks if chunk.prompt_first_token), None
            ),
        )


@dataclass(frozen=True)
class ModelInfo:
    """What the cluster serves; ``dtype`` is empty until a decode worker registered."""

    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    aliases: tuple[str, ...] = ()
    """Other names requests may ask for ``model`` by."""
    checkpoint: str = ""
    """The checkpoint's name, which its workers announce."""
    adapters: tuple[str, ...] = ()
    """The LoRA adapters its workers serve now: names a request may use as its model (the
    base model's tokenizer and context; each adapter's own weights)."""
    tool_call_format: str = "json"
    """How its chat answers call tools (``client/tools.py:TOOL_FORMATS``)."""
    reasoning_format: str = ""
    """How its answers hold their reasoning ("": none; ``client/reasoning.py``)."""


@dataclass(frozen=True)
class LoadedAdapter:
    """A LoRA adapter loaded at runtime (``load_lora_adapter``): its name, the digest of its
    files as the workers read them, and how many worker processes serve it now."""

    name: str
    digest: str
    workers: int
