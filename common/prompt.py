"""What a request's prompt may be, and how it becomes token ids (torch-free).

One definition for every entry point: the coordinator takes a ``Prompt`` (text, chat
messages or token ids), the offline ``LLM`` API text or token ids (``TextOrTokens``; chats go
through ``LLM.chat``). ``encode_prompt`` is the one place prompts are validated and tokenized.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from splitserve.common.chat_messages import ChatMessage, template_messages
from splitserve.common.errors import InvalidRequestError
from splitserve.common.tokenizer import Tokenizer

ChatMessages = Sequence[ChatMessage | Mapping[str, str]]
"""Chat messages (``ChatMessage``, or plain ``{"role", "content"}`` mappings), rendered with
the model's chat template (``common/chat_messages.py:template_messages``)."""
TextOrTokens = str | Sequence[int]
"""Text (tokenized with the model's special tokens), or token ids used as they are."""


@dataclass(frozen=True)
class Chat:
    """Chat messages with how the chat template renders them (``Tokenizer.apply_chat_template``;
    plain ``ChatMessages`` are this with the defaults)."""

    messages: ChatMessages
    template_kwargs: Mapping[str, object] = field(default_factory=dict)
    """More variables for the template (vLLM's ``chat_template_kwargs``, JSON values)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template: str | None = None
    """The request's own chat template (vLLM's ``chat_template``), instead of the model's."""


Prompt = TextOrTokens | ChatMessages | Chat


def is_chat(prompt: Prompt) -> bool:
    """Whether ``prompt`` is chat messages (a ``Chat``, or a non-empty sequence of messages)."""
    if isinstance(prompt, Chat):
        return True
    return (
        not isinstance(prompt, str)
        and len(prompt) > 0
        and isinstance(prompt[0], ChatMessage | Mapping)
    )


def encode_prompt(
    tokenizer: Tokenizer, prompt: Prompt, add_special_tokens: bool | None = None
) -> list[int]:
    """Token ids of ``prompt``; ``InvalidRequestError`` (param "prompt") when it is empty or
    holds something other than a token id of the vocabulary. Chat messages are rendered with
    the generation prompt appended. ``add_special_tokens`` (vLLM's): whether the tokenizer
    adds its special tokens (BOS, ... where the model asks for them) to text; None: yes for
    text, no for chat messages, whose template writes its own. Token ids are used as given."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        return tokenizer.encode(prompt, add_special_tokens is not False)
    if isinstance(prompt, Chat):
        if not prompt.messages:
            raise InvalidRequestError("messages must not be empty", "messages")
        template = prompt.template or tokenizer.chat_template
        messages = template_messages(prompt.messages, template)
        text = tokenizer.apply_chat_template(
            messages,  # type: ignore[arg-type]
            prompt.add_generation_prompt,
            prompt.continue_final_message,
            prompt.template_kwargs,
            prompt.template,
        )
        return tokenizer.encode(text, bool(add_special_tokens))
    if not prompt:
        raise InvalidRequestError("prompt must not be empty", "prompt")
    if is_chat(prompt):
        return encode_prompt(tokenizer, Chat(prompt), add_special_tokens)  # type: ignore[arg-type]
    token_ids = list(prompt)
    if any(not isinstance(token, int) or isinstance(token, bool) for token in token_ids):
        raise InvalidRequestError("prompt token ids must be integers", "prompt")
    check_in_vocab(token_ids, tokenizer.vocab_size, "prompt token ids", "prompt")
    return token_ids  # type: ignore[return-value]


TRUNCATE_TO_CONTEXT = -1
"""``truncate_prompt_tokens`` asking for as much of the prompt as the context takes."""


def truncated(token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """The prompt's last ``keep`` tokens (vLLM's ``truncate_prompt_tokens``): all of them for
    None, the last ``max_model_len - 1`` for ``TRUNCATE_TO_CONTEXT`` (one token left to
    generate). ``InvalidRequestError`` naming the field for another value below 1."""
    if keep is None:
        return token_ids
    if keep == TRUNCATE_TO_CONTEXT:
        keep = max(1, max_model_len - 1)
    if keep < 1:
        raise InvalidRequestError(
            "truncate_prompt_tokens must be at least 1, or -1 for the context's length",
            "truncate_prompt_tokens",
        )
    return token_ids[-keep:]


def min_prompt_tokens(tokenizer: Tokenizer, prompt: Prompt) -> int:
    """A lower bound on ``len(encode_prompt(tokenizer, prompt))`` that costs no tokenizing
    (``Tokenizer.max_chars_per_token``): 0 when the tokenizer gives no bound. Lets a caller
    refuse a prompt far over the context before spending seconds tokenizing it."""
    if not isinstance(prompt, str | Chat) and prompt and not is_chat(prompt):
        return len(prompt)  # token ids
    per_token = tokenizer.max_chars_per_token
    if not per_token or not prompt:
        return 0
    return -(-prompt_chars(prompt) // per_token)


def prompt_chars(prompt: Prompt) -> int:
    """The characters a prompt's tokenizing reads at least: its text, or its chat messages'
    contents (the template only adds); 0 for token ids, which are not tokenized."""
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, Chat):
        return prompt_chars(prompt.messages)
    if is_chat(prompt):
        return sum(len(_content(m)) for m in prompt)  # type: ignore[arg-type]
    return 0


def _content(message: ChatMessage | Mapping[str, str]) -> str:
    if isinstance(message, ChatMessage):
        return message.content
    return str(message.get("content") or "")


def check_in_vocab(token_ids: Sequence[int], vocab: int, what: str, param: str) -> None:
    """``InvalidRequestError`` ("<what> must be in [0, vocab)", ``param``) unless every id is a
    token of the vocabulary."""
    if any(not 0 <= token < vocab for token in token_ids):
        raise InvalidRequestError(f"{what} must be in [0, {vocab})", param)
