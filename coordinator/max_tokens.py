"""A request's ``max_tokens``, settled in one place: ``settle_max_tokens``.

The rules (docs/api.md, "OpenAI-compatible gateway"): a request that asks for ``max_tokens`` gets
it, unless that is above the operator's cap (``--max-tokens-cap``: INVALID_ARGUMENT). One that
asks for none may grow to fill the context every decode worker can hold
(``Coordinator.fill_limit``), within the operator's default (``--default-max-tokens``, raised to
the request's ``min_tokens``; 0: no default) and cap. Either way its prompt and
``max_tokens`` must fit the context window (``ContextLengthExceededError``). Defaults of the
API above (a completion's 16 tokens, as in vLLM) are the gateway's: it asks for them.

Everything here is pure: the coordinator hands in what it knows of the cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.common.errors import ContextLengthExceededError, InvalidRequestError

NO_ROOM_MAX_TOKENS = 16
"""``max_tokens`` of a request that asked for none when its prompt already fills
``OutputLimits.fill_limit`` (its ``min_tokens`` when more): the context check decides."""


@dataclass(frozen=True)
class OutputLimits:
    """What bounds one request's output: the operator's flags and the decode workers now."""

    default_max_tokens: int
    """``max_tokens`` of a request that asked for none, at most (0: up to ``fill_limit``)."""
    max_tokens_cap: int
    """The most ``max_tokens`` a request may get; 0: no cap."""
    max_model_len: int
    """The largest decode worker's context window, prompt included (0: no check)."""
    fill_limit: int
    """Tokens (prompt + output) every decode worker can hold: what a request that asked for no
    ``max_tokens`` may grow to."""


def fewest_max_tokens(asked: int | None) -> int:
    """The fewest output tokens ``settle_max_tokens`` may settle on, known before the prompt is
    tokenized: what the request asked for, else 1."""
    return 1 if asked is None else asked


def settle_max_tokens(
    asked: int | None, min_tokens: int, num_prompt_tokens: int, limits: OutputLimits
) -> int:
    """The request's ``max_tokens``: ``asked`` (None: the caller set none) by the module's
    rules. Raises ``InvalidRequestError`` (param "max_tokens") for an asked value over the cap,
    ``ContextLengthExceededError`` when prompt + ``max_tokens`` exceed the context window.

    A default below ``min_tokens`` (the room or the cap is smaller) is returned as is: making
    the params then refuses the request's ``min_tokens`` (``SamplingParams``)."""
    if asked is None:
        max_tokens = _fill(min_tokens, num_prompt_tokens, limits)
    else:
        _check_cap(asked, limits.max_tokens_cap)
        max_tokens = asked
    _check_context(num_prompt_tokens, max_tokens, limits.max_model_len)
    return max_tokens


def _fill(min_tokens: int, num_prompt_tokens: int, limits: OutputLimits) -> int:
    """The room left in ``fill_limit``, within the default (not below ``min_tokens``) and the
    cap; ``NO_ROOM_MAX_TOKENS`` (or ``min_tokens``) when there is none."""
    room = limits.fill_limit - num_prompt_tokens
    if room <= 0:
        return max(NO_ROOM_MAX_TOKENS, min_tokens)
    wanted = room
    if limits.default_max_tokens > 0:
        wanted = min(wanted, max(limits.default_max_tokens, min_tokens))
    if limits.max_tokens_cap > 0:
        wanted = min(wanted, limits.max_tokens_cap)
    return wanted


def _check_cap(asked: int, cap: int) -> None:
    if cap > 0 and asked > cap:
        raise InvalidRequestError(
            f"max_tokens is {asked}; this server allows at most {cap}", "max_tokens"
        )


def _check_context(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    if max_model_len and num_prompt_tokens + max_tokens > max_model_len:
        raise ContextLengthExceededError(
            f"this model's context is {max_model_len} tokens; the prompt has "
            f"{num_prompt_tokens} and max_tokens is {max_tokens}",
            "max_tokens" if num_prompt_tokens < max_model_len else "prompt",
        )
