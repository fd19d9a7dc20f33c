"""Several choices in one response: a list of prompts in ``/v1/completions`` and ``n > 1``.

A request of P prompts with ``n`` choices each is P x n streams through the client, choice
``p * n + j`` (OpenAI's order) answering prompt ``p`` with its ``j``-th sampling
(``client/choices.py:choice_samplings``). Each choice has its own ``ResponseBuilder``
(``index`` set) behind one response id; ``Choices`` keeps them and ``client/choices.py:merged``
interleaves their streams as items arrive.

Contracts:
- ``merged`` yields ``(choice index, item)`` in arrival order and ends when every stream
  ended; the first failure of any stream is raised (the others are cancelled); closing it
  closes every stream (their gRPC calls are cancelled). One stream is passed through without
  tasks or a queue.
- Forks (``n > 1``): a stream may follow another (``leaders``): it starts only once its
  leader streamed its first item (or ended), so the prompt was computed once and its KV
  blocks sit in the prefix caches of the workers that served the leader. The gateway gives a
  prompt's choices one session id (the request's own ``x-session-id``, else the response
  id's), so they decode on the same worker and each follower reserves the prompt's full
  blocks from its cache, shared with the leader; only the last partial block is computed
  and moved again (``gateway/app.py:_generate``).
- Usage: prompt tokens (and cached ones) count once per prompt, as OpenAI counts ``n``;
  completion tokens add up over every choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from splitserve.client import Chunk, Finish, Usage
from splitserve.gateway.errors import ApiError
from splitserve.gateway.responses import ResponseBuilder, usage_dict

Item = Chunk | Finish


class Choices:
    """The builders of one response, by choice index; ``prompt_of[i]`` is choice ``i``'s
    prompt (usage counts each prompt once)."""

    def __init__(
        self,
        builders: Sequence[ResponseBuilder],
        prompt_of: Sequence[int],
        keep_best: int | None = None,
    ) -> None:
        """``keep_best``: ``best_of``'s ``n``: of each prompt's choices only the ``keep_best``
        with the highest cumulative logprob of their sampled tokens return (whole responses
        only), re-indexed in that order; None: every choice."""
        if len(builders) != len(prompt_of) or not builders:
            raise ValueError("one prompt index per builder, at least one builder")
        self.keep_best = keep_best
        self.cumulative_logprob = [0.0] * len(builders)
        self.builders = list(builders)
        for builder in self.builders[1:]:  # one response: one creation time on every chunk
            builder.created = self.builders[0].created
        self.prompt_of = list(prompt_of)
        self.finished = 0

    @property
    def all_finished(self) -> bool:
        return self.finished == len(self.builders)

    def opening_chunks(self) -> list[dict[str, Any]]:
        return [chunk for builder in self.builders for chunk in builder.opening_chunks()]

    def add(self, index: int, item: Item) -> list[dict[str, Any]]:
        """Fold choice ``index``'s item in; its streamed events (none: nothing to send yet)."""
        builder = self.builders[index]
        if isinstance(item, Chunk):
            self.cumulative_logprob[index] += sum(entry.logprob for entry in item.logprobs)
        if isinstance(item, Finish):
            self.finished += 1
            return builder.finish(item)
        return builder.add(item)

    def usage(self) -> Usage:
        """What the request used so far (the module docstring's rule)."""
        prompts: dict[int, Usage] = {}
        completion = 0
        for builder, prompt in zip(self.builders, self.prompt_of, strict=True):
            if builder.usage is None:
                continue
            prompts.setdefault(prompt, builder.usage)
            completion += builder.usage.completion_tokens
        return Usage(
            prompt_tokens=sum(u.prompt_tokens for u in prompts.values()),
            completion_tokens=completion,
            cached_tokens=sum(u.cached_tokens for u in prompts.values()),
        )

    def error_events(self, error: ApiError) -> list[dict[str, Any]]:
        """What ends the stream when it fails after it began (the first builder's shape)."""
        return self.builders[0].error_events(error)

    def whole(self) -> dict[str, Any]:
        """The non-streamed response: every choice, in index order, and the request's usage
        (one choice: its builder's own response, whatever its shape)."""
        if len(self.builders) == 1:
            return self.builders[0].whole()
        wholes = [builder.whole() for builder in self.builders]
        body = wholes[0]
        choices = [whole["choices"][0] for whole in wholes]
        body["choices"] = choices if self.keep_best is None else self._best(choices)
        body["usage"] = usage_dict(self.usage())
        return body

    def _best(self, choices: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each prompt's ``keep_best`` choices by cumulative logprob (ties: lower index)."""
        kept: list[dict[str, Any]] = []
        for prompt in sorted(set(self.prompt_of)):
            mine = [i for i, p in enumerate(self.prompt_of) if p == prompt]
            mine.sort(key=lambda i: -self.cumulative_logprob[i])
            kept += [
                {**choices[i], "index": len(kept) + k} for k, i in enumerate(mine[: self.keep_best])
            ]
        return kept

    def usage_chunk(self) -> dict[str, Any]:
        body = self.builders[0].usage_chunk()
        body["usage"] = usage_dict(self.usage())
        return body
