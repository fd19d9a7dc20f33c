"""What a request's prompt may be, and how it becomes token ids (torch-free).

One definition for every entry point: the coordinator takes a ``Prompt`` (text, chat
messages or token ids), the offline ``LLM`` API text or token ids (``TextOrTokens``; chats go
through ``LLM.chat``). ``encode_prompt`` is the one place prompts are validated and tokenized.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from splitserve.common.errors import InvalidRequestError
from splitserve.common.tokenizer import Tokenizer

ChatMessages = Sequence[Mapping[str, str]]
"""Chat messages ({"role", "content"}), rendered with the model's chat template."""
TextOrTokens = str | Sequence[int]
"""Text (tokenized with the model's special tokens), or token ids used as they are."""
Prompt = TextOrTokens | ChatMessages


def encode_prompt(tokenizer: Tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of ``prompt``; ``InvalidRequestError`` (param "prompt") when it is empty or
    holds something other than a token id of the vocabulary. Chat messages are rendered with
    the generation prompt appended."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        return tokenizer.encode(prompt)
    if not prompt:
        raise InvalidRequestError("prompt must not be empty", "prompt")
    if isinstance(prompt[0], Mapping):
        messages = [dict(message) for message in prompt]  # type: ignore[arg-type]
        return tokenizer.encode(tokenizer.apply_chat_template(messages))
    token_ids = list(prompt)
    if any(not isinstance(token, int) or isinstance(token, bool) for token in token_ids):
        raise InvalidRequestError("prompt token ids must be integers", "prompt")
    check_in_vocab(token_ids, tokenizer.vocab_size, "prompt token ids", "prompt")
    return token_ids


def min_prompt_tokens(tokenizer: Tokenizer, prompt: Prompt) -> int:
    """A lower bound on ``len(encode_prompt(tokenizer, prompt))`` that costs no tokenizing
    (``Tokenizer.max_chars_per_token``): 0 when the tokenizer gives no bound. Lets a caller
    refuse a prompt far over the context before spending seconds tokenizing it."""
    if not isinstance(prompt, str) and prompt and not isinstance(prompt[0], Mapping):
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
    if prompt and isinstance(prompt[0], Mapping):
        return sum(len(str(m.get("content") or "")) for m in prompt)  # type: ignore[union-attr]
    return 0


def check_in_vocab(token_ids: Sequence[int], vocab: int, what: str, param: str) -> None:
    """``InvalidRequestError`` ("<what> must be in [0, vocab)", ``param``) unless every id is a
    token of the vocabulary."""
    if any(not 0 <= token < vocab for token in token_ids):
        raise InvalidRequestError(f"{what} must be in [0, {vocab})", param)
