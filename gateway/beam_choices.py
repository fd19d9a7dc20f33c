"""vLLM's ``use_beam_search`` on the OpenAI routes: each prompt's ``n`` choices are the ``n``
best beams of one search (``client/beam_search.py``, width ``n``, ``length_penalty``), in
score order, each a choice stream of one ``Chunk`` (the beam's tokens and text) and its
``Finish``, made when the search ended; so the endpoint's builders answer in their own shape,
whole or streamed (the stream then carries each choice at once, at the end).

Beam search ranks tokens by the model's log-probabilities, so the fields that change how a
token is sampled or which are allowed (temperature, top-p/k, min-p, penalties, logit bias,
structured outputs, tools, allowed tokens, bad words), stop strings and logprobs are refused
by name (a 400), never ignored; ``max_tokens`` (16 when unset), ``min_tokens``,
``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens``, ``seed`` (nothing is drawn) and
``cache_salt`` are served.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from splitserve.client import AsyncClient, Chunk, Finish, Sampling, Usage
from splitserve.client.beam_search import Beam, BeamSearchParams
from splitserve.gateway.errors import ApiError, client_errors_as_api_errors

DEFAULT_MAX_TOKENS = 16
"""A beam search's steps when the request sets no ``max_tokens`` (OpenAI's completions
default): each step is a round of requests, so the context's length is no default."""

Item = Chunk | Finish

_UNSET_SAMPLING = {
    "temperature": (None, 0.0),
    "top_p": (None, 1.0),
    "top_k": (None,),
    "min_p": (None, 0.0),
    "repetition_penalty": (None, 1.0),
    "frequency_penalty": (None, 0.0),
    "presence_penalty": (None, 0.0),
    "stop": ((),),
    "logprobs": (None,),
    "logit_bias": (None, {}),
    "grammar": (None,),
    "prompt_logprobs": (None,),
    "allowed_token_ids": (None,),
    "bad_words": ((),),
    "include_stop_str_in_output": (False,),
}
"""The sampling fields beam search refuses unless they ask for nothing (one of these)."""
_FIELD_OF = {"grammar": "response_format"}
"""The request field to name where a sampling field is not one."""


def beam_search_params(body: Any, sampling: Sampling) -> BeamSearchParams:
    """The search ``body`` asks for (``use_beam_search``), its ``sampling`` the endpoint's
    reading of it; ``ApiError`` 400 naming the first field it cannot take."""
    width = body.n or 1
    if body.best_of is not None and body.best_of != width:
        raise ApiError(400, "beam search keeps n beams: send best_of equal to n or none",
                       param="best_of")  # fmt: skip
    for name, unset in _UNSET_SAMPLING.items():
        if getattr(sampling, name) not in unset:
            field = _FIELD_OF.get(name, name)
            raise ApiError(400, f"beam search does not take {field}", param=field)
    if getattr(body, "tools", None):
        raise ApiError(400, "beam search does not take tools", param="tools")
    try:
        return BeamSearchParams(
            width=width,
            max_tokens=sampling.max_tokens or DEFAULT_MAX_TOKENS,
            length_penalty=1.0 if body.length_penalty is None else body.length_penalty,
            ignore_eos=sampling.ignore_eos,
            min_tokens=sampling.min_tokens or 0,
            stop_token_ids=tuple(sampling.stop_token_ids),
        )
    except ValueError as error:  # InvalidRequestError names the field
        raise ApiError(400, str(error), param=getattr(error, "param", None)) from None


@dataclass
class PromptBeams:
    """One prompt's search, shared by its choices: started by the first choice stream read,
    cancelled when a choice stream closes before it ended (the response was abandoned)."""

    search: Callable[[], Awaitable[list[Beam]]]
    """Runs the search (``client/beam_search.py:served_beams`` for this prompt)."""
    client: AsyncClient
    prompt_tokens: int
    skip_special_tokens: bool
    _task: asyncio.Task[list[Beam]] | None = None

    def _beams(self) -> asyncio.Task[list[Beam]]:
        if self._task is None:
            self._task = asyncio.ensure_future(self.search())
        return self._task

    async def choice(self, index: int, request_id: str) -> AsyncGenerator[Item, None]:
        """Choice ``index``'s stream: the ``index``-th best beam as one chunk, then its end."""
        task = self._beams()
        try:
            with client_errors_as_api_errors():
                beams = await asyncio.shield(task)
                beam = beams[index] if index < len(beams) else Beam((), 0.0, "length")
                text = await self.client.detokenize(
                    beam.token_ids, skip_special_tokens=self.skip_special_tokens
                )
        finally:
            if not task.done():
                task.cancel()
        usage = Usage(self.prompt_tokens, len(beam.token_ids), 0)
        yield Chunk(request_id, text, beam.token_ids, (), usage)
        yield Finish(request_id, beam.finish_reason, beam.stop_token_id, usage)
