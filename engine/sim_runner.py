"""A runner that stands in for the model: it waits out a real step's time and emits set tokens.

``SimulatedRunner`` keeps ``ModelRunner``'s contract (``execute(SchedulerOutput) ->
RunnerOutput``: one token per sampling chunk, one per row of a chunk with drafts; the layer
hook once per layer in steps that complete a prompt; KV blocks read and written by id), so
everything around it is the real thing: the scheduler and block pool (KV accounting, prefix
hits, preemption), the worker's gRPC services, membership, admission signals, drain, and the
KV transfer over UCX. What it does not do is compute:

- **Time.** A step lasts what the profile's step-cost model (``engine/sim_profile.py``,
  fitted to a real engine's steps) predicts for its shape, slept on the engine thread
  (which, like torch's kernels, holds no GIL meanwhile). In a step that completes a prompt
  the sleep is cut into one slice per layer, each followed by that layer's hook, so the
  prefill worker's layer-by-layer KV push overlaps the step as it does for real. The
  scheduler's own work comes on top, as it does for a real step (well under 1% of it).
- **KV.** The cache has the model's layers and the real block count and block size, but one
  KV head of ``STAND_IN_HEAD_DIM`` values per token (bf16): transfers move real bytes, a few
  per token and layer instead of the model's ~24 KB a token. Nothing here reads them.
- **Tokens.** The token after the one at position ``p - 1`` is ``sim_token(words, that
  token, p)``: a function of the previous token and the position only, so a request gets the
  same tokens whichever path it took (prefilled here or elsewhere, resumed, continued, its
  drafts verified). ``words`` are the ids of an English paragraph in the model's tokenizer
  (readable text, never an end-of-sequence token: a request runs to ``max_tokens``, as with
  ``ignore_eos``). Sampling parameters do not change it; a constrained request takes the
  grammar's allowed token nearest to it (so grammars still bind and end); a request asking
  for logprobs gets the token at logprob 0 (rank 1) and the next words at ``-30``; its
  ``prompt_logprobs`` give each prompt token 0 (rank 1) where it is the token the simulation
  would have chosen there, else ``-30`` (rank 2), with that token's alternatives.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

import torch

from splitserve.common.logprobs import TokenLogprob
from splitserve.common.tokenizer import Tokenizer
from splitserve.engine.grammar_matchers import GrammarMatchers
from splitserve.engine.kv_blocks import KvBlockStore
from splitserve.engine.model_runner import RunnerOutput
from splitserve.engine.scheduler import ScheduledChunk, SchedulerOutput
from splitserve.engine.sim_profile import SimProfile
from splitserve.transfer.paced import LinkModel

STAND_IN_HEAD_DIM = 2
"""Values per token, layer, K or V in a simulated engine's cache (one head, bf16: 4 bytes; a
block's K or V of one layer, the smallest message a transfer sends, is then 64 bytes for
16-token blocks). The default model's cache at its real block count is 11 MB this way."""
OTHER_LOGPROB = -30.0
"""The logprob a simulated engine reports for every token but the one it emits."""
_WORDS_TEXT = (
    " The river runs past the old mill where the miller kept his stones and his books, and"
    " every morning the children walked along the bank to the school on the hill. They counted"
    " boats, named the birds, and argued about the weather, the harvest, the price of bread"
    " and whether the bridge would hold another winter. Nobody remembered who built it first."
)


def word_token_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The distinct ids of ``_WORDS_TEXT`` in ``tokenizer``, special tokens left out, in
    ascending order (the same for every worker with the same tokenizer)."""
    ids = set(tokenizer.encode(_WORDS_TEXT, add_special_tokens=False))
    return tuple(sorted(ids - tokenizer.all_special_ids))


def sim_token(words: Sequence[int], previous: int, position: int) -> int:
    """The token a simulated engine emits at ``position`` after ``previous``."""
    return words[(previous * 2654435761 + position * 40503) % len(words)]


class SimulatedRunner(KvBlockStore):
    """``ModelRunner``'s contract with a profile's step times and ``sim_token``'s tokens."""

    def __init__(
        self,
        profile: SimProfile,
        words: Sequence[int],
        num_layers: int,
        num_blocks: int,
        block_size: int,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.perf_counter,
        seed: int = 0,
    ) -> None:
        super().__init__(
            num_layers,
            num_blocks,
            block_size,
            1,
            STAND_IN_HEAD_DIM,
            torch.bfloat16,
            torch.device("cpu"),
        )
        if not words:
            raise ValueError("a simulated runner needs at least one word token")
        self.profile = profile
        self.words = tuple(words)
        self.num_layers = num_layers
        self._sleep = sleep
        self._clock = clock
        self._draws = random.Random(seed)
        """Each step's draw of the profile's step-time ratio (``SimProfile.draw_ratio``)."""
        self.grammars: GrammarMatchers | None = None
        """Constrained requests' matchers (set by the engine, as for ``ModelRunner``)."""

    def link_model(self) -> LinkModel | None:
        """The link this engine's KV transfers are paced on: the profile's measured figures,
        scaled from the stand-in's bytes a token to the real model's; None where the profile
        carries none."""
        profile = self.profile
        if profile.transfer_gbps <= 0 or profile.kv_bytes_per_token <= 0:
            return None
        layers, _, _, _, heads, dim = self.kv_cache.shape
        stand_in = layers * 2 * heads * dim * self.kv_cache.element_size()  # per token
        scale = profile.kv_bytes_per_token / stand_in
        return LinkModel(profile.transfer_gbps, profile.transfer_latency_s, scale)

    def execute(
        self,
        step: SchedulerOutput,
        on_layer_kv_written: Callable[[int], None] | None = None,
        between_layers: Callable[[], None] | None = None,
    ) -> RunnerOutput:
        """Wait out the step's predicted time (hooking each layer in turn where asked), then
        return the tokens of every sampling chunk. ``between_layers`` is not called: a
        simulated step has no thread pool to resize."""
        for request_id in step.finished_request_ids:
            if self.grammars is not None:
                self.grammars.free(request_id)
        if not step.chunks:
            return RunnerOutput()
        shape = step.shape()
        ratio = self.profile.draw_ratio(self._draws.random(), shape.prefill_tokens > 0)
        self._wait(ratio * self.profile.step_s(shape), on_layer_kv_written)
        output = RunnerOutput()
        for chunk in step.chunks:
            if chunk.num_prompt_logprobs:
                output.prompt_logprobs[chunk.request_id] = self._prompt_logprobs(chunk)
            if not chunk.samples:
                continue
            if chunk.draft_token_ids:  # no grammar, no logprobs (``Scheduler._speculates``)
                output.verified_token_ids[chunk.request_id] = tuple(
                    sim_token(self.words, token, chunk.start_position + j + 1)
                    for j, token in enumerate(chunk.token_ids)
                )
                continue
            token = self._token(chunk)
            output.sampled_token_ids[chunk.request_id] = token
            if chunk.params.logprobs is not None:
                output.logprobs[chunk.request_id] = self._logprob(token, chunk.params.logprobs)
        return output

    def _wait(self, seconds: float, on_layer_kv_written: Callable[[int], None] | None) -> None:
        if on_layer_kv_written is None:
            self._sleep(seconds)
            return
        started = self._clock()
        for layer in range(self.num_layers):
            due = started + seconds * (layer + 1) / self.num_layers
            self._sleep(max(0.0, due - self._clock()))
            on_layer_kv_written(layer)

    def _token(self, chunk: ScheduledChunk) -> int:
        token = sim_token(self.words, chunk.token_ids[-1], chunk.context_length)
        if chunk.params.grammar is None:
            return token
        if self.grammars is None:
            raise RuntimeError("a constrained request reached an engine without grammars")
        allowed = self.grammars.allowed(
            chunk.request_id, chunk.params.grammar, chunk.output_token_ids, chunk.eos_token_ids
        )  # [vocab] bool
        if bool(allowed[token]):
            return token
        allowed_ids = allowed.nonzero().flatten()  # [allowed]
        if allowed_ids.numel() == 0:  # never: a matcher allows end-of-sequence at least
            raise RuntimeError(f"request {chunk.request_id}: the grammar allows no token")
        return int(allowed_ids[token % allowed_ids.numel()])

    def _prompt_logprobs(self, chunk: ScheduledChunk) -> tuple[int, tuple[TokenLogprob, ...]]:
        """The chunk's prompt records (``RunnerOutput.prompt_logprobs``; module docstring)."""
        first, prompt = chunk.start_position + 1, chunk.prompt_token_ids
        records = []
        for position in range(first, first + chunk.num_prompt_logprobs):
            chosen = sim_token(self.words, prompt[position - 1], position)
            top = self._logprob(chosen, chunk.params.prompt_logprobs or 0).top
            token = prompt[position]
            hit = token == chosen
            records.append(TokenLogprob(token, 0.0 if hit else OTHER_LOGPROB, 1 if hit else 2, top))
        return first, tuple(records)

    def _logprob(self, token: int, num_top: int) -> TokenLogprob:
        others = [(word, OTHER_LOGPROB) for word in self.words if word != token]
        return TokenLogprob(token, 0.0, 1, ((token, 0.0), *others)[:num_top])
