"""Prompt logprobs (``SamplingParams.prompt_logprobs``) equal HF ``transformers``' in float32.

Reference: HF's logits over the whole prompt, ``log_softmax`` in float32; record ``i``
describes prompt token ``i + 1`` under the logits at position ``i``. Checked in one engine
whose prompts are chunked (a budget of 32 tokens a step), whose prefix cache holds the prompt
(a second request must compute it whole again), and whose KV pool is small enough to preempt a
prompt half computed (its chunks computed again replace their records).
"""

from __future__ import annotations

import pytest
import torch

from splitserve.common.errors import InvalidRequestError
from splitserve.common.sampling_params import MAX_LOGPROBS, SamplingParams
from splitserve.engine.request import Request
from splitserve.engine.sampler import token_logprobs
from splitserve.engine.scheduler import Scheduler
from tests.conftest import assert_no_leaks, make_llm

transformers = pytest.importorskip("transformers")

_TEXT = (
    "The lighthouse keeper climbed the spiral stairs each evening, counting the steps as his "
    "father had taught him. Below, the harbour emptied of boats, and the gulls settled on the "
    "breakwater."
)
TOP = 3


@pytest.fixture(scope="module")
def prompt(default_checkpoint_fp32) -> list[int]:
    ids = default_checkpoint_fp32.tokenizer.encode(_TEXT)
    assert len(ids) > 32, len(ids)  # more than one 32-token chunk, more than two blocks
    return ids


@pytest.fixture(scope="module")
def hf_prompt_logprobs(prompt, hf_default_model_fp32) -> torch.Tensor:
    """``[len(prompt) - 1, vocab]``: row ``i`` is the distribution of prompt token ``i + 1``."""
    with torch.inference_mode():
        logits = hf_default_model_fp32(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits.to(torch.float32), dim=-1)


def _assert_matches_hf(records, prompt: list[int], reference: torch.Tensor, top: int) -> None:
    assert [record.token_id for record in records] == prompt[1:]
    for position, record in enumerate(records):
        row = reference[position]  # [vocab]
        want = row[prompt[position + 1]].item()
        assert record.logprob == pytest.approx(want, abs=2e-4), position
        # 1 + the tokens more likely; a token within float32 noise of it may go either way
        assert int((row > want + 2e-4).sum()) + 1 <= record.rank, position
        assert record.rank <= int((row > want - 2e-4).sum()) + 1, position
        values, ids = row.topk(top)
        assert [token for token, _ in record.top] == ids.tolist(), position
        assert [value for _, value in record.top] == pytest.approx(values.tolist(), abs=2e-4)


def test_prompt_logprobs_equal_hf_chunked_cached_and_preempted(
    default_checkpoint_fp32, prompt, hf_prompt_logprobs, monkeypatch
) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=TOP, logprobs=1)
    plain = SamplingParams(max_tokens=4, temperature=0.0)
    llm = make_llm(default_checkpoint_fp32, max_num_batched_tokens=32)
    (first,) = llm.generate([prompt], params)
    _assert_matches_hf(first.prompt_logprobs, prompt, hf_prompt_logprobs, TOP)
    # The first output token's logprob is the last prompt position's distribution.
    (cached,) = llm.generate([prompt], plain)
    assert cached.num_cached_tokens > 0  # the prompt's blocks are in the prefix cache now
    (again,) = llm.generate([prompt], params)
    assert again.num_cached_tokens == 0  # computed whole: each row's logits are needed
    assert again.prompt_logprobs == first.prompt_logprobs
    assert again.token_ids == cached.token_ids == first.token_ids
    assert cached.prompt_logprobs == []
    assert_no_leaks(llm)

    # Six blocks of 16 for three prompts of 3 blocks and 20 tokens each: prompts are
    # preempted half computed (seen: at 15 and 31 tokens), and computed again.
    preempted_mid_prompt = []
    preempt = Scheduler._preempt

    def recording(scheduler: Scheduler, request: Request) -> None:
        if not request.output_token_ids:
            preempted_mid_prompt.append(request.num_computed_tokens)
        preempt(scheduler, request)

    monkeypatch.setattr(Scheduler, "_preempt", recording)
    small = make_llm(default_checkpoint_fp32, num_blocks=6, max_num_batched_tokens=32)
    sampling = SamplingParams(max_tokens=20, temperature=0.0, prompt_logprobs=0)
    results = small.generate([prompt] * 3, sampling)
    assert any(0 < computed < len(prompt) for computed in preempted_mid_prompt)
    for result in results:
        _assert_matches_hf(result.prompt_logprobs, prompt, hf_prompt_logprobs, 0)
        assert all(record.top == () for record in result.prompt_logprobs)
    assert_no_leaks(small)


def test_prompt_logprobs_are_bounded() -> None:
    with pytest.raises(InvalidRequestError) as raised:
        SamplingParams(prompt_logprobs=MAX_LOGPROBS + 1)
    assert raised.value.param == "prompt_logprobs"
    with pytest.raises(InvalidRequestError):
        SamplingParams(prompt_logprobs=-1)


def test_ranks_read_among_the_top_equal_the_full_count() -> None:
    """``token_logprobs`` reads a rank among the row's 32 most likely tokens where the chosen
    one is among them, else counts over the vocabulary: the same rank either way, ties
    included (equal logits are not "more likely")."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 1000, generator=generator)  # [rows, vocab]
    logits[6, :40] = 5.0  # forty tied tokens lead row 6
    order = logits.argsort(dim=-1, descending=True)  # [rows, vocab]
    places = [0, 4, 31, 32, 33, 500, 10, 39]  # 0-based place of each row's chosen token
    chosen = torch.tensor([order[row, place] for row, place in enumerate(places)])
    records = token_logprobs(logits, chosen, [2] * 8)
    logprobs = torch.log_softmax(logits, dim=-1)
    for row, record in enumerate(records):
        want = int((logprobs[row] > logprobs[row, chosen[row]]).sum()) + 1
        assert record.rank == want, (row, places[row])
        assert record.token_id == int(chosen[row]) and len(record.top) == 2
    assert records[6].rank == 1  # tied with the 39 others before it
