"""vLLM's ``return_tokens_as_token_ids``: each token in a response's logprobs named
``token_id:<id>`` instead of by its text (so a client can map them back to ids whatever the
text, e.g. tokens of partial UTF-8 characters).

Contract: ``named_by_id(chunk)`` is the chunk with every logprob record's text (the token's,
its alternatives', the prompt's and the prompt's first token) replaced by its id's name; its
generated text is untouched. ``named_by_id_stream`` applies it to each chunk of a stream and
closes the stream it wraps when it is closed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator

from splitserve.client import Chunk, Finish, PromptToken, TokenLogprob, TopLogprob


def token_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def _named(record: TokenLogprob) -> TokenLogprob:
    top = tuple(TopLogprob(t.token_id, t.logprob, token_name(t.token_id)) for t in record.top)
    return dataclasses.replace(record, text=token_name(record.token_id), top=top)


def named_by_id(chunk: Chunk) -> Chunk:
    """``chunk`` with its logprob records named by id (module docstring)."""
    first = chunk.prompt_first_token
    return dataclasses.replace(
        chunk,
        logprobs=tuple(_named(record) for record in chunk.logprobs),
        prompt_logprobs=tuple(_named(record) for record in chunk.prompt_logprobs),
        prompt_first_token=None
        if first is None
        else PromptToken(first.token_id, token_name(first.token_id)),
    )


async def named_by_id_stream(
    stream: AsyncGenerator[Chunk | Finish, None],
) -> AsyncGenerator[Chunk | Finish, None]:
    """Each item of ``stream``, chunks named by id; closing this closes ``stream``."""
    try:
        async for item in stream:
            yield named_by_id(item) if isinstance(item, Chunk) else item
    finally:
        await stream.aclose()
