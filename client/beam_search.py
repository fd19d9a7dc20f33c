"""Beam search over a served model (vLLM's ``use_beam_search``), step by step through the
client: each live beam asks the cluster for its next token's most likely candidates (a request
of one token with ``2 x width`` logprobs), and the ``width`` best extensions live on. Torch-
free; the gateway (``use_beam_search``) and Python callers (``AsyncClient.beam_search``) share
it, and the tests run the same search over an in-process engine.

Contract (``search``):
- A beam is a sequence of generated tokens and the sum of their log-probabilities under the
  model (the raw logits' ``log_softmax``, as every reported logprob).
- Each step extends every live beam by each of its ``2 x width`` most likely next tokens (all
  of them when the vocabulary is smaller); a candidate that is an EOS token (unless
  ``ignore_eos``) or one of ``stop_token_ids`` ends its beam ("stop"), except before
  ``min_tokens`` tokens, when it is dropped. Of the other candidates the ``width`` of highest
  sum live on (ties: the earlier beam, then the more likely token, as the candidates come).
- After ``max_tokens`` steps the live beams end ("length"). Of every ended beam the ``width``
  of highest score return, best first, where the score is the sum over ``length **
  length_penalty`` and ``length`` counts the beam's tokens but a final stop token (at least
  1).
- Requests are independent: each step's prompt is the prompt and the beam's tokens, whose KV
  the workers' prefix caches mostly hold from the step before, so a step computes about one
  block.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.client.types import Sampling
from splitserve.common.errors import InvalidRequestError
from splitserve.common.sampling_params import MAX_LOGPROBS

if TYPE_CHECKING:  # the client imports this module
    from splitserve.client.async_client import AsyncClient

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2
"""Widest beam: a step asks for ``2 x width`` candidates, within a request's logprobs."""

NextTokens = Callable[[Sequence[int], int], Awaitable[Sequence[tuple[int, float]]]]
"""``(token ids, count)`` -> the ``count`` most likely next tokens after those ids (the prompt
then a beam's tokens), each ``(token id, logprob)``, most likely first."""


@dataclass(frozen=True)
class BeamSearchParams:
    """What ``search`` looks for; validated on construction (``InvalidRequestError`` naming
    the field)."""

    width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.width <= MAX_BEAM_WIDTH:
            raise InvalidRequestError(
                f"beam search takes n (the beam width) from 1 to {MAX_BEAM_WIDTH}", "n"
            )
        if self.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be at least 1", "max_tokens")
        if not -10.0 <= self.length_penalty <= 10.0:
            raise InvalidRequestError("length_penalty must be in [-10, 10]", "length_penalty")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError("min_tokens must be in [0, max_tokens]", "min_tokens")

    @property
    def candidates(self) -> int:
        """Next tokens each step asks per beam."""
        return 2 * self.width


@dataclass(frozen=True)
class BeamResult:
    """A beam and its text (``AsyncClient.beam_search``)."""

    beam: Beam
    text: str


@dataclass(frozen=True)
class Beam:
    """A generated sequence, its log-probability and how it ended ("" while live)."""

    token_ids: tuple[int, ...]
    logprob: float
    finish_reason: str = ""
    stop_token_id: int | None = None

    def score(self, length_penalty: float) -> float:
        """``logprob / length ** length_penalty``; ``length`` without a final stop token."""
        length = len(self.token_ids) - (self.stop_token_id is not None)
        return self.logprob / max(length, 1) ** length_penalty


async def search(
    prompt_ids: Sequence[int],
    params: BeamSearchParams,
    eos_token_ids: Sequence[int],
    next_tokens: NextTokens,
) -> list[Beam]:
    """The ``params.width`` best beams after ``prompt_ids`` (module docstring), best first."""
    stops = set(params.stop_token_ids)
    if not params.ignore_eos:
        stops.update(eos_token_ids)
    live = [Beam((), 0.0)]
    ended: list[Beam] = []
    for step in range(params.max_tokens):
        tops = await asyncio.gather(
            *(next_tokens([*prompt_ids, *beam.token_ids], params.candidates) for beam in live)
        )
        extended: list[Beam] = []
        for beam, top in zip(live, tops, strict=True):
            for token_id, logprob in top:
                longer = Beam((*beam.token_ids, token_id), beam.logprob + logprob)
                if token_id not in stops:
                    extended.append(longer)
                elif step >= params.min_tokens:
                    ended.append(Beam(longer.token_ids, longer.logprob, "stop", token_id))
        extended.sort(key=lambda beam: beam.logprob, reverse=True)  # stable: ties keep order
        live = extended[: params.width]
        if not live:
            break
    ended += [Beam(beam.token_ids, beam.logprob, "length") for beam in live]
    ended.sort(key=lambda beam: beam.score(params.length_penalty), reverse=True)
    return ended[: params.width]


async def served_beams(
    client: AsyncClient,
    prompt_ids: Sequence[int],
    params: BeamSearchParams,
    eos_token_ids: Sequence[int],
    *,
    request_id: str,
    model: str = "",
    session_id: str = "",
    priority: int = 0,
    traceparent: str = "",
    cache_salt: str | None = None,
) -> list[Beam]:
    """``search`` over the cluster ``client`` reaches (``eos_token_ids``: its model's, from
    ``ModelInfo``, which the caller holds): each step's requests are named
    ``<request_id>-beam-<k>`` and share ``session_id`` (one decode worker, whose prefix cache
    then holds each beam's tokens for its next step) and ``cache_salt``."""
    steps = itertools.count()

    async def next_tokens(token_ids: Sequence[int], count: int) -> list[tuple[int, float]]:
        sampling = Sampling(
            max_tokens=1, temperature=0.0, logprobs=count, ignore_eos=True, cache_salt=cache_salt
        )
        generation = await client.generate(
            token_ids=token_ids,
            sampling=sampling,
            request_id=f"{request_id}-beam-{next(steps)}",
            model=model,
            session_id=session_id,
            priority=priority,
            traceparent=traceparent,
        )
        return [(top.token_id, top.logprob) for top in generation.logprobs[0].top]

    return await search(prompt_ids, params, eos_token_ids, next_tokens)
