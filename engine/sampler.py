"""Batched next-token sampling with per-request penalties, filters, seeds and logprobs.

One ``Sampler.__call__`` turns a step's logits ``[batch, vocab]`` (any float dtype) and one
``SamplingRow`` per row into one token id per row (plus logprobs where asked for).

Order of operations (vLLM / OpenAI semantics), all in float32:

0. **grammar**: a row with an ``allowed_token_mask`` (its structured output's next tokens)
   or ``params.allowed_token_ids`` (which exclude a grammar) has every other token set to
   ``-inf``; then **bad words**: the tokens that would complete one of
   ``params.bad_words_token_ids`` after the row's output (``common/bad_words.py``) are set to
   ``-inf``. Where step 1 would then leave a masked row no token (the grammar is complete and
   allows only EOS, which ``min_tokens`` suppresses), the mask wins and step 1 is skipped for
   that row.
1. **min_tokens**: while a row has generated fewer than ``params.min_tokens`` tokens, its
   ``eos_token_ids`` and ``params.stop_token_ids`` are set to ``-inf``; then **logit_bias**:
   each (token, bias) of ``params.logit_bias`` is added to that token's logit.
2. **repetition penalty** (tokens in prompt or output): a positive logit is divided by the
   penalty, a negative one multiplied by it.
3. **frequency / presence penalties** (output tokens only): minus ``frequency_penalty`` times
   the token's count, minus ``presence_penalty`` if the count is positive.
4. ``temperature == 0``: argmax of the penalized logits. Otherwise divide by the temperature,
   then **top-k** (keep the k largest), **top-p** (keep the smallest most-likely set whose mass
   reaches ``top_p``; the top token is always kept), **min-p** (drop tokens whose probability
   is below ``min_p`` times the top token's), then sample from what is left. Cut-offs are logit
   values: tokens tied with the last kept one are kept too.

Steps 1-3 are ``apply_penalties`` and step 4's filters are ``apply_filters``; both are public so
their exact effect can be checked on hand-made logits. Logprobs are computed from the *raw*
logits (``log_softmax`` before penalties and temperature), like vLLM's default and OpenAI.

Reproducibility contract: a sampled row inverts the cumulative distribution of
``softmax(filtered logits / temperature)`` (in vocabulary order, float32) at one uniform ``U``:
the token ``i`` with ``cdf[i - 1] <= U * cdf[-1] < cdf[i]``, so a token of probability 0 is
never drawn. A row's ``U`` comes from that row's own ``generator``: exactly ``DRAWS_PER_TOKEN``
draw of ``torch.rand`` per sampled step (``advance`` skips what sampled tokens drew); greedy
steps and logprobs draw nothing. Every other operation is row-wise, and whether a row takes
the top-k/top-p path (or its full-sort fallback) depends on that row alone. So a seeded
request given the same logits yields the same tokens whatever else is in the batch and
whatever its row index. Rows with ``generator=None`` share one module-level generator per
device, seeded from OS entropy. (Bitwise-equal *logits* across batch shapes are the model's
concern, not the sampler's.) Until 2026-11-28 it was the exponential race
(``argmax(logits - log E)``, ``vocab`` draws a step): the same distribution, but three
transcendental operations and a draw per vocabulary entry where this takes one ``exp`` and a
running sum, 2.6 ms against 0.8 ms for 8 rows of SmolLM2's 49,152 on one core of the AMD
EPYC, a tenth of a decode step there; a seed gives other tokens than it did then.

On the CPU (``Sampler(kernels)``, what ``ModelRunner`` builds there): step 4's temperature,
filters and draw, and the logprobs, run in C++ (``kernels/cpu_sampling.py``), one call per
step, each row in a few passes over its logits instead of torch's top-k of candidates,
log-sum-exp, masks, softmax, cumulative sum and search. The contract above holds with its
sums in double: a token equals the torch path's except where a uniform or a top-p lands
within float rounding of a boundary between two tokens' cumulative masses (torch sums in
float32, in its own order; ``tests/test_cpu_sampling.py`` checks both against float64). On
the default model's real logits on one core of the AMD EPYC (Zen 5) a top-p 0.95 row takes
about 44 us instead of 411 (bench/log/2026-11.md, "Sampling in C++").

Hot path: when every row is greedy and needs no penalty, the batch is one ``argmax`` on the
logits as given, with no per-row tensor work.

Wait-free choice (``Sampler.choose(..., wait_free=True)``, what a decode step launched ahead
runs): the same tokens, with nothing read on the host. Top-k/top-p first look at
``_NUCLEUS_TIERS[0]`` tokens per row; whether they held a top-p row's cut-off is known on
the device only, so instead of reading it, every row whose cut-off may lie beyond them is
sorted as well and keeps the cut-off of the first tier that held it (the sorted prefix stands
for the later tiers). On one core of the AMD
EPYC (Zen 5) that sort makes a peaked 8-row choice over 49,152 tokens 18 ms instead of 1.5;
flat rows, sorted either way, cost the same (``bench/bench_kernels_gpu.py:bench_top_p_choice``
times it on a GPU, where only steps launched ahead use it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from splitserve.common.bad_words import banned_tokens
from splitserve.common.logprobs import TokenLogprob
from splitserve.common.sampling_params import SamplingParams, changes_logits
from splitserve.engine.host_copies import to_device
from splitserve.kernels.cpu_sampling import CpuSampling

_NEG_INF = float("-inf")
DRAWS_PER_TOKEN = 1
"""Uniforms a seeded row's generator gives per sampled token (the reproducibility contract):
what ``_uniforms`` draws and ``advance`` skips; ``_inverse_cdf_sample`` reads them as one
``[n, 1]`` column, so it is one."""


@dataclass
class SamplingRow:
    """One request's row in this step's batch."""

    params: SamplingParams
    generator: torch.Generator | None
    """Per-request generator created from ``params.seed`` by the engine; None = unseeded."""
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    """Tokens generated so far (before this step)."""
    eos_token_ids: frozenset[int]
    """Suppressed (with ``params.stop_token_ids``) until ``params.min_tokens`` are generated."""
    allowed_token_mask: torch.Tensor | None = None
    """bool ``[vocab]``: the only tokens this row may take (its grammar's), or None."""
    pending_outputs: int = 0
    """Tokens the row generated before this step that ``output_token_ids`` does not hold yet:
    1 for a row of a step launched ahead whose input is the step before's token, still on the
    device (``ModelRunner.launch_decode``). Only counts read them (``min_tokens``): such a row
    is ``decided_on_device``, so nothing here reads its outputs' values."""

    @property
    def num_outputs(self) -> int:
        """Tokens the row generated before this step."""
        return len(self.output_token_ids) + self.pending_outputs


@dataclass(frozen=True)
class SamplerOutput:
    """One sampled token per row, and its logprobs (None where the row did not ask)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    """Stateless batched sampler; see the module docstring for semantics.

    ``kernels``: the C++ sampling kernels (``kernels/cpu_sampling.py``), which take step 4's
    filters and draw, and the logprobs, for logits on the CPU; None keeps torch's ops."""

    def __init__(self, kernels: CpuSampling | None = None) -> None:
        self.kernels = kernels

    def choose(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], *, wait_free: bool = False
    ) -> torch.Tensor:
        """Each row's token, ``[batch]`` int64 on the logits' device, not read on the host:
        what ``__call__`` returns as a list.

        ``wait_free``: where every row is ``decided_on_device`` (no grammar, no logprobs,
        nothing that ``changes_logits``), nothing here waits for the device (host values
        reach it through pinned memory, ``engine/host_copies.py``), so it can queue a step's
        choice behind its forward (``ModelRunner.launch_decode``). The one value the device
        alone knows, whether a top-p row's nucleus lies within its candidates, is then not
        read: every row whose nucleus may lie beyond them also gets its full-sort cut-off,
        and the device picks the one the row needs. The tokens are those of
        ``wait_free=False``, which sorts only the rows that need it (a read of the device).
        """
        if all(row.params.greedy and not _needs_penalties(row) for row in rows):
            return logits.argmax(dim=-1)  # [batch]
        if self.kernels is not None and logits.device.type == "cpu":
            return _sample_native(logits, rows, self.kernels)  # [batch]
        return _sample(logits, rows, wait_free)  # [batch]

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """Pick one token per row of ``logits`` ``[batch, vocab]`` (``len(rows) == batch``)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [batch={len(rows)}, vocab], got {tuple(logits.shape)}"
            )
        if not rows:
            return SamplerOutput(token_ids=[], logprobs=[])
        token_ids = self.choose(logits, rows)  # [batch]
        return SamplerOutput(
            token_ids=token_ids.tolist(),
            logprobs=compute_logprobs(logits, token_ids, rows, self.kernels),
        )


def _sample(logits: torch.Tensor, rows: Sequence[SamplingRow], wait_free: bool) -> torch.Tensor:
    """General path: penalties, then argmax for greedy rows and filtered sampling for others
    (``wait_free`` as in ``Sampler.choose``)."""
    processed = apply_penalties(logits, rows)  # [batch, vocab] float32
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    if not sampled:
        return processed.argmax(dim=-1)  # [batch]
    device = logits.device
    sampled_params = [rows[i].params for i in sampled]
    temperatures = _row_values(sampled_params, "temperature", torch.float32, device)  # [n]
    # Every row samples: work in place on `processed` (a private copy); else on its rows.
    index = None if len(sampled) == len(rows) else to_device(sampled, torch.int64, device)  # [n]
    scores = processed if index is None else processed[index]  # [n, vocab]
    scores.div_(temperatures[:, None])
    _filter_in_place(scores, sampled_params, wait_free)
    drawn = _inverse_cdf_sample(scores, [rows[i].generator for i in sampled])  # [n]
    if index is None:
        return drawn
    token_ids = processed.argmax(dim=-1)  # [batch]: the greedy rows'
    token_ids[index] = drawn
    return token_ids


def _sample_native(
    logits: torch.Tensor, rows: Sequence[SamplingRow], kernels: CpuSampling
) -> torch.Tensor:
    """``_sample`` with the sampled rows' temperature, filters and draw in one C++ call per
    step (``CpuSampling.sample``: the same contract; the penalties stay torch's). Logits on the
    CPU; ``[batch]`` int64."""
    if any(_needs_penalties(row) for row in rows):
        processed = apply_penalties(logits, rows)  # [batch, vocab] float32, a copy
    else:  # the kernel reads them as they are: no copy for float32 logits
        processed = logits.to(torch.float32).contiguous()  # [batch, vocab]
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    if not sampled:
        return processed.argmax(dim=-1)  # [batch]
    every_row = len(sampled) == len(rows)
    scores = processed if every_row else processed[torch.tensor(sampled)]  # [n, vocab]
    params = [rows[i].params for i in sampled]
    vocab = logits.shape[1]
    drawn = kernels.sample(
        scores,
        temperature=_row_values(params, "temperature", torch.float32, scores.device),
        top_k=torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params]),
        top_p=_row_values(params, "top_p", torch.float32, scores.device),
        min_p=_row_values(params, "min_p", torch.float32, scores.device),
        uniform=_uniforms([rows[i].generator for i in sampled], scores.device)[:, 0].contiguous(),
    )  # [n]
    if every_row:
        return drawn
    token_ids = processed.argmax(dim=-1)  # [batch]: the greedy rows'
    token_ids[sampled] = drawn
    return token_ids


# --------------------------------------------------------------------------- penalties


def _needs_penalties(row: SamplingRow) -> bool:
    """True when ``apply_penalties`` would change this row's logits."""
    return row.allowed_token_mask is not None or changes_logits(
        row.params, row.num_outputs, row.eos_token_ids
    )


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Return float32 logits ``[batch, vocab]`` after min_tokens suppression and penalties.

    The input is not modified. Tensors are built only for the rows that need each step.
    """
    processed = logits.to(torch.float32, copy=True)  # [batch, vocab]
    masked: list[int] = []
    for i, row in enumerate(rows):
        allowed = _allowed_mask(row, processed.shape[1], processed.device)  # [vocab] bool
        if allowed is not None:
            processed[i].masked_fill_(~allowed, _NEG_INF)
            masked.append(i)
    _ban_bad_words(processed, rows)
    before = processed[to_device(masked, torch.int64, logits.device)] if masked else None
    # [masked, vocab]: a copy (index tensors copy)
    _suppress_stop_tokens(processed, rows)
    for k, i in enumerate(masked):  # a complete grammar allows only EOS: it beats min_tokens
        assert before is not None
        if torch.isneginf(processed[i]).all():
            processed[i] = before[k]
    _apply_logit_bias(processed, rows)
    _apply_repetition_penalty(processed, rows)
    _apply_frequency_presence_penalties(processed, rows)
    return processed


def _allowed_mask(row: SamplingRow, vocab: int, device: torch.device) -> torch.Tensor | None:
    """``[vocab]`` bool: the tokens a row may take (its grammar's, or its
    ``allowed_token_ids``), None when it may take any."""
    if row.allowed_token_mask is not None:
        return row.allowed_token_mask.to(device)
    ids = row.params.allowed_token_ids
    if ids is None:
        return None
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[[token_id for token_id in ids if token_id < vocab]] = True
    return allowed.to(device)


def _ban_bad_words(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Set (in place) to -inf each row's tokens that would complete a bad word after its
    output (``common/bad_words.py:banned_tokens``)."""
    vocab = logits.shape[1]
    row_index: list[int] = []
    token_index: list[int] = []
    for i, row in enumerate(rows):
        sequences = row.params.bad_words_token_ids
        if not sequences:
            continue
        for token_id in banned_tokens(sequences, row.output_token_ids):
            if token_id < vocab:
                row_index.append(i)
                token_index.append(token_id)
    if row_index:
        logits[row_index, token_index] = _NEG_INF


def _suppress_stop_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Set eos and stop token ids to -inf (in place) for rows still below ``min_tokens``;
    the indices reach the device without waiting for it (a step launched ahead runs this)."""
    vocab = logits.shape[1]
    row_index: list[int] = []
    token_index: list[int] = []
    for i, row in enumerate(rows):
        if row.num_outputs >= row.params.min_tokens:
            continue
        for token_id in row.eos_token_ids.union(row.params.stop_token_ids):
            if token_id < vocab:
                row_index.append(i)
                token_index.append(token_id)
    if row_index:
        rows_at = to_device(row_index, torch.int64, logits.device)  # [n]
        tokens_at = to_device(token_index, torch.int64, logits.device)  # [n]
        logits[rows_at, tokens_at] = _NEG_INF


def _apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Add (in place) each row's ``logit_bias`` to its tokens' logits (ids past the vocab,
    which the coordinator refuses, are skipped)."""
    vocab = logits.shape[1]
    row_index: list[int] = []
    token_index: list[int] = []
    biases: list[float] = []
    for i, row in enumerate(rows):
        for token_id, bias in row.params.logit_bias:
            if token_id < vocab:
                row_index.append(i)
                token_index.append(token_id)
                biases.append(bias)
    if row_index:
        logits[row_index, token_index] += to_device(biases, torch.float32, logits.device)


def _apply_repetition_penalty(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Penalize (in place) tokens seen in prompt or output: x > 0 -> x / p, else x * p."""
    selected = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    if not selected:
        return
    device = logits.device
    seen_ids = [[*rows[i].prompt_token_ids, *rows[i].output_token_ids] for i in selected]
    seen = _token_counts(seen_ids, logits.shape[1], device) > 0  # [n, vocab]
    index = to_device(selected, torch.int64, device)  # [n]
    penalty = _row_values(
        [rows[i].params for i in selected], "repetition_penalty", torch.float32, device
    )[:, None]  # [n, 1]
    current = logits[index]  # [n, vocab]
    penalized = torch.where(current > 0, current / penalty, current * penalty)
    logits[index] = torch.where(seen, penalized, current)


def _apply_frequency_presence_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Subtract (in place) ``f * count + p * (count > 0)`` over each row's output tokens."""
    selected = [
        i
        for i, row in enumerate(rows)
        if row.params.frequency_penalty != 0.0 or row.params.presence_penalty != 0.0
    ]
    if not selected:
        return
    device = logits.device
    output_ids = [list(rows[i].output_token_ids) for i in selected]
    counts = _token_counts(output_ids, logits.shape[1], device)  # [n, vocab]
    params = [rows[i].params for i in selected]
    frequency = _row_values(params, "frequency_penalty", torch.float32, device)[:, None]
    presence = _row_values(params, "presence_penalty", torch.float32, device)[:, None]
    index = to_device(selected, torch.int64, device)  # [n]
    logits[index] -= frequency * counts + presence * (counts > 0).to(torch.float32)


def _token_counts(ids: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[n, vocab]`` float32: how often each token occurs in ``ids[i]``."""
    rows = [torch.as_tensor(row_ids, dtype=torch.long) for row_ids in ids]
    padded = pad_sequence(rows, batch_first=True, padding_value=vocab).to(device)  # [n, len]
    counts = torch.zeros(len(ids), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab]  # column `vocab` only absorbed the padding


def _row_values(
    params: Sequence[SamplingParams], field: str, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """One parameter per row as a tensor ``[n]``."""
    return to_device([getattr(p, field) for p in params], dtype, device)


# --------------------------------------------------------------------------- filters


_NUCLEUS_TIERS = (256, 4096)
"""Top-k/top-p look first at each row's 256 most likely tokens, then, for a row whose cut-off
lies beyond them (a top-k above 256, or a flat distribution), at its 4,096 most likely, and
only for a row whose cut-off lies beyond those too at its fully sorted vocabulary. A tier's
values are the sorted vocabulary's first ones, so every tier that holds a row's cut-off finds
the same one; which tier decides a row depends on that row alone. At temperature 1 and top-p
0.95, a quarter of SmolLM2's steps have a nucleus beyond 256 tokens and nearly none beyond
4,096 (bench/log/2026-11.md, "Top-p at temperature 1 without sorting the vocabulary"): the
second tier spares them a sort of the vocabulary."""


def apply_filters(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) what top-k, top-p and min-p drop; ``logits`` ``[n, vocab]`` is scaled.

    Returns a new tensor. The most likely token of each row is never dropped. Cut-offs are
    logit values, so tokens tied with the last kept one are kept too (no arbitrary tie
    order). Rows without top-k/top-p skip that work, so a row's result never depends on its
    neighbours.
    """
    filtered = logits.clone()  # [n, vocab]
    _filter_in_place(filtered, params, wait_free=False)
    return filtered


def _filter_in_place(
    logits: torch.Tensor, params: Sequence[SamplingParams], wait_free: bool
) -> None:
    """``apply_filters`` on ``logits`` ``[n, vocab]`` itself (``wait_free`` as in
    ``Sampler.choose``)."""
    vocab = logits.shape[1]
    nucleus_rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
    top_k_top_p = _top_k_top_p_wait_free if wait_free else _top_k_top_p
    _on_rows(logits, nucleus_rows, params, top_k_top_p)
    min_p_rows = [i for i, p in enumerate(params) if p.min_p > 0.0]
    _on_rows(logits, min_p_rows, params, _min_p)


def _on_rows(
    logits: torch.Tensor,
    selected: list[int],
    params: Sequence[SamplingParams],
    transform: Callable[[torch.Tensor, Sequence[SamplingParams]], torch.Tensor],
) -> None:
    """Replace rows ``selected`` of ``logits`` by ``transform(those rows, their params)``."""
    if not selected:
        return
    if len(selected) == logits.shape[0]:
        logits.copy_(transform(logits, params))
        return
    index = to_device(selected, torch.int64, logits.device)  # [m]
    logits[index] = transform(logits[index], [params[i] for i in selected])


@dataclass(frozen=True)
class _NucleusRows:
    """Top-k/top-p rows' settings on the device, and their cut-off within the first tier."""

    top_k: torch.Tensor  # [m] int64, vocab = disabled
    top_p: torch.Tensor  # [m] float32
    threshold: torch.Tensor  # [m]: the lowest logit kept, as far as the first tier tells
    complete: torch.Tensor  # [m] bool: the first tier held the row's cut-off

    @staticmethod
    def of(logits: torch.Tensor, params: Sequence[SamplingParams]) -> _NucleusRows:
        """Each row's cut-off among its ``_NUCLEUS_TIERS[0]`` most likely tokens, from
        ``logits`` ``[m, vocab]``; nothing read on the host."""
        device = logits.device
        vocab = logits.shape[1]
        top_k = to_device(
            [p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.long, device
        )  # [m]
        top_p = _row_values(params, "top_p", torch.float32, device)  # [m]
        candidates = logits.topk(min(_NUCLEUS_TIERS[0], vocab), dim=-1).values  # [m, c]
        k_active = any(0 < p.top_k < vocab for p in params)
        threshold, complete = _cutoff(logits, candidates, top_k, top_p, k_active)
        return _NucleusRows(top_k, top_p, threshold, complete)

    def cutoff_among(
        self, rows: torch.Tensor, redo: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cut-off of rows ``redo`` ``[r]`` (their logits ``rows`` ``[r, vocab]``) among
        ``values`` ``[r, c]``, their c largest logits in descending order, and whether those
        held it; each ``[r]``."""
        return _cutoff(rows, values, self.top_k[redo], self.top_p[redo], k_active=True)


def _later_tiers(vocab: int) -> list[int]:
    """The tiers after the first that are narrower than ``vocab`` (then the sort)."""
    return [width for width in _NUCLEUS_TIERS[1:] if width < vocab]


def _top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Top-k then top-p on ``[m, vocab]`` logits, each row decided by the first tier that
    holds its cut-off (``_NUCLEUS_TIERS``, then the sorted vocabulary); which rows a tier did
    not decide is read on the host, so only those go on to the next."""
    nucleus = _NucleusRows.of(logits, params)
    threshold = nucleus.threshold  # [m]
    pending = torch.nonzero(~nucleus.complete).flatten()  # [r]: a read on the host
    for width in _later_tiers(logits.shape[1]):
        if pending.numel() == 0:
            break
        rows = logits[pending]  # [r, vocab]
        values = rows.topk(width, dim=-1).values  # [r, width]
        threshold[pending], held = nucleus.cutoff_among(rows, pending, values)
        pending = pending[~held]  # a read on the host
    if pending.numel() > 0:
        rows = logits[pending]  # [r, vocab]
        everything = rows.sort(dim=-1, descending=True).values  # [r, vocab]
        threshold[pending] = nucleus.cutoff_among(rows, pending, everything)[0]
    return logits.masked_fill(logits < threshold[:, None], _NEG_INF)


def _top_k_top_p_wait_free(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``_top_k_top_p`` with nothing read on the host: every row whose cut-off may lie beyond
    the first tier (a top-p, or a top-k larger than it) is sorted, each later tier's cut-off
    is taken from the sorted values' prefix (the same values ``topk`` gives), and the device
    keeps, per row, the cut-off of the first tier that held it. The same result, at the cost of
    sorting those rows whether they need it or not."""
    nucleus = _NucleusRows.of(logits, params)
    threshold = nucleus.threshold  # [m]
    vocab = logits.shape[1]
    first = min(_NUCLEUS_TIERS[0], vocab)
    unsure = [  # a top-p, or an active top-k beyond the first tier
        i for i, p in enumerate(params) if p.top_p < 1.0 or first < p.top_k < vocab
    ]
    if unsure:
        redo = to_device(unsure, torch.int64, logits.device)  # [r]
        rows = logits[redo]  # [r, vocab]
        everything = rows.sort(dim=-1, descending=True).values  # [r, vocab]
        chosen = nucleus.cutoff_among(rows, redo, everything)[0]  # [r]
        for width in reversed(_later_tiers(vocab)):
            prefix = everything[:, :width].contiguous()  # [r, width]: what topk(width) gives
            within, held = nucleus.cutoff_among(rows, redo, prefix)
            chosen = torch.where(held, within, chosen)
        threshold[redo] = torch.where(nucleus.complete[redo], threshold[redo], chosen)
    return logits.masked_fill(logits < threshold[:, None], _NEG_INF)


def _cutoff(
    logits: torch.Tensor,
    candidates: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    k_active: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lowest logit each row keeps under top-k then top-p, and whether ``candidates`` sufficed.

    ``logits`` ``[m, vocab]``; ``candidates`` ``[m, c]`` the c largest logits, descending;
    ``top_k`` ``[m]`` (vocab = disabled); ``top_p`` ``[m]``; ``k_active``: some row has a
    top-k (known on the host; masking with no top-k changes nothing, so skipping it cannot
    change a row's result). Top-p keeps the smallest prefix whose probability (renormalized
    after top-k) reaches ``top_p``, at least one token.
    """
    vocab = logits.shape[1]
    num_candidates = candidates.shape[1]
    kth = candidates.gather(1, (top_k.clamp(max=num_candidates) - 1)[:, None])  # [m, 1]
    kth = kth.masked_fill((top_k >= vocab)[:, None], _NEG_INF)
    k_complete = (top_k <= num_candidates) | (top_k >= vocab)  # [m]
    top_k_masked = logits.masked_fill(logits < kth, _NEG_INF) if k_active else logits
    log_norm = top_k_masked.logsumexp(dim=-1, keepdim=True)  # [m, 1]
    probs = (candidates.masked_fill(candidates < kth, _NEG_INF) - log_norm).exp()  # [m, c]
    cumulative = probs.cumsum(dim=-1)  # [m, c]
    num_kept = ((cumulative - probs) < top_p[:, None]).sum(dim=-1).clamp(min=1)  # [m]
    pth = candidates.gather(1, (num_kept - 1)[:, None])  # [m, 1]
    pth = pth.masked_fill(top_p[:, None] >= 1.0, _NEG_INF)
    p_complete = (top_p >= 1.0) | (cumulative[:, -1] >= top_p) | (num_candidates >= vocab)
    return torch.maximum(kth, pth)[:, 0], k_complete & p_complete


def _min_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Drop tokens with ``p < min_p * p_max``, i.e. ``logit < max_logit + log(min_p)``."""
    min_p = _row_values(params, "min_p", torch.float32, logits.device)  # [m]
    threshold = logits.max(dim=-1, keepdim=True).values + min_p.log()[:, None]  # [m, 1]
    return logits.masked_fill(logits < threshold, _NEG_INF)


# --------------------------------------------------------------------------- randomness

_DEFAULT_GENERATORS: dict[torch.device, torch.Generator] = {}


def _default_generator(device: torch.device) -> torch.Generator:
    """The shared generator for unseeded rows on ``device`` (seeded from OS entropy)."""
    generator = _DEFAULT_GENERATORS.get(device)
    if generator is None:
        generator = torch.Generator(device=device)
        generator.seed()
        _DEFAULT_GENERATORS[device] = generator
    return generator


def _uniforms(generators: Sequence[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """``U ~ Uniform[0, 1)``, ``[n, 1]`` float32; row i's ``DRAWS_PER_TOKEN`` from
    ``generators[i]`` (the shared generator's for None, drawn together)."""
    uniform = torch.empty(len(generators), DRAWS_PER_TOKEN, dtype=torch.float32, device=device)
    unseeded = [i for i, generator in enumerate(generators) if generator is None]
    if unseeded:
        shared = _default_generator(device)
        drawn = torch.rand(len(unseeded), DRAWS_PER_TOKEN, generator=shared, device=device)
        if len(unseeded) == len(generators):
            uniform.copy_(drawn)
        else:
            uniform[to_device(unseeded, torch.int64, device)] = drawn
    for i, generator in enumerate(generators):
        if generator is not None:
            row = torch.rand(DRAWS_PER_TOKEN, generator=generator, device=generator.device)
            uniform[i] = row.to(device)
    return uniform


def _inverse_cdf_sample(
    scores: torch.Tensor,  # [n, vocab] float32: filtered logits over the temperature
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """One token per row of ``softmax(scores)``, ``[n]`` int64: where the row's cumulative
    distribution first passes its uniform times its total (see the reproducibility contract).
    The target stays below the total, so the token found has a probability above 0."""
    cdf = torch.softmax(scores, dim=-1).cumsum_(dim=-1)  # [n, vocab], non-decreasing
    total = cdf[:, -1:]  # [n, 1]
    target = torch.minimum(
        _uniforms(generators, scores.device) * total,
        torch.nextafter(total, torch.zeros_like(total)),
    )  # [n, 1], in [0, total)
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def advance(generator: torch.Generator, sampled_tokens: int) -> None:
    """Move a seeded request's ``generator`` past the draws of ``sampled_tokens`` sampled
    steps (a first token sampled by another worker; draft rows a step drew for nothing)."""
    if sampled_tokens > 0:
        torch.rand(sampled_tokens * DRAWS_PER_TOKEN, generator=generator, device=generator.device)


# --------------------------------------------------------------------------- logprobs


def compute_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    rows: Sequence[SamplingRow],
    kernels: CpuSampling | None = None,
) -> list[TokenLogprob | None]:
    """Logprobs of ``token_ids`` ``[batch]`` under ``log_softmax(logits)`` (raw logits).

    Only rows with ``params.logprobs is not None`` are computed; the others get None.
    ``kernels`` as in ``token_logprobs``.
    """
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    result: list[TokenLogprob | None] = [None] * len(rows)
    if not wanted:
        return result
    index = to_device(wanted, torch.int64, logits.device)  # [n]
    records = token_logprobs(
        logits[index], token_ids[index], [rows[i].params.logprobs or 0 for i in wanted], kernels
    )
    for i, record in zip(wanted, records, strict=True):
        result[i] = record
    return result


_RANKED_AMONG_TOP = 32
"""A chosen token among a row's this many most likely has its rank counted among them, not
over the vocabulary (``token_logprobs``; the same count)."""


def token_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    counts: Sequence[int],
    kernels: CpuSampling | None = None,
) -> list[TokenLogprob]:
    """One record per row of ``logits`` ``[n, vocab]`` (raw, any float dtype): token
    ``token_ids[i]`` (``[n]`` int64)'s logprob under ``log_softmax`` in float32, its rank and
    the ``counts[i]`` most likely tokens. The one formula of every logprob the engine
    reports, a generated token's and a prompt token's. ``kernels``: for logits on the CPU,
    one C++ pass per row (``CpuSampling.token_logprobs``: the log-normalizer summed in
    double, ranks and top counted on the values reported, ties in the top by lower id);
    torch's ops otherwise."""
    if kernels is not None and logits.device.type == "cpu":
        return _token_logprobs_native(logits, token_ids, counts, kernels)
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [n, vocab]
    chosen = token_ids.to(torch.long)  # [n]
    chosen_logprobs = logprobs.gather(1, chosen[:, None])  # [n, 1]
    num_top = min(max(counts, default=0), logprobs.shape[1])
    width = min(max(num_top, _RANKED_AMONG_TOP), logprobs.shape[1])
    top_logprobs, top_ids = logprobs.topk(width, dim=-1)  # [n, width] each
    # Every token more likely than a chosen one at least as likely as the top's last is in
    # the top: its rank is read there; the other rows compare against the whole vocabulary.
    ranks = (top_logprobs > chosen_logprobs).sum(dim=-1, dtype=torch.int32) + 1  # [n]
    beyond = chosen_logprobs[:, 0] < top_logprobs[:, -1]  # [n]
    if bool(beyond.any()):
        rows = beyond.nonzero()[:, 0]  # [beyond]
        wide = logprobs[rows] > chosen_logprobs[rows]  # [beyond, vocab]
        ranks[rows] = wide.sum(dim=-1, dtype=torch.int32) + 1
    top_ids, top_logprobs = top_ids[:, :num_top], top_logprobs[:, :num_top]
    return _records(chosen, chosen_logprobs[:, 0], ranks, top_ids, top_logprobs, counts)


def _records(
    chosen: torch.Tensor,  # [n] int64
    chosen_logprobs: torch.Tensor,  # [n] float32
    ranks: torch.Tensor,  # [n] integer
    top_ids: torch.Tensor,  # [n, num_top] int64, most likely first
    top_logprobs: torch.Tensor,  # [n, num_top] float32
    counts: Sequence[int],  # each row's top count, <= num_top
) -> list[TokenLogprob]:
    """The rows' ``TokenLogprob`` records, read on the host once."""
    chosen_list = chosen.tolist()
    chosen_lp_list = chosen_logprobs.tolist()
    rank_list = ranks.tolist()
    top_lp_list = top_logprobs.tolist()
    top_id_list = top_ids.tolist()
    return [
        TokenLogprob(
            token_id=chosen_list[j],
            logprob=chosen_lp_list[j],
            rank=rank_list[j],
            top=tuple(zip(top_id_list[j][:count], top_lp_list[j][:count], strict=True)),
        )
        for j, count in enumerate(counts)
    ]


def _token_logprobs_native(
    logits: torch.Tensor, token_ids: torch.Tensor, counts: Sequence[int], kernels: CpuSampling
) -> list[TokenLogprob]:
    """``token_logprobs`` by ``CpuSampling.token_logprobs`` (logits on the CPU)."""
    rows = kernels.token_logprobs(
        logits.to(torch.float32).contiguous(),  # [n, vocab]
        token_ids.to(torch.int64).contiguous(),  # [n]
        min(max(counts, default=0), logits.shape[1]),
    )
    return _records(token_ids, rows.logprob, rows.rank, rows.top_ids, rows.top_logprobs, counts)
