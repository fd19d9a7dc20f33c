"""A request resumed with its earlier output (``EngineCore.add_request(...,
prior_output_token_ids)``, what a decode worker gets when a request moves to it) goes on
exactly as if it had never moved: seeded sampling continues its random stream, penalties see
the earlier tokens as output, ``min_tokens``/``max_tokens`` count them, a grammar's matcher
continues from them. Float32, one engine,
each request run whole and then resumed from several points."""

from __future__ import annotations

import pytest

from splitserve.common.errors import InvalidRequestError
from splitserve.common.grammar import GrammarSpec
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.checkpoint import LoadedCheckpoint
from splitserve.engine.engine_core import EngineCore
from tests.conftest import assert_no_leaks, make_llm

pytestmark = pytest.mark.timeout(300)

PROMPT_TEXT = "Once upon a time, in a village by the sea, there lived"
MAX_TOKENS = 24
PARAMS = {
    "seeded": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=1234),
    "seeded-with-penalties": SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=0.8,
        seed=7,
        frequency_penalty=0.7,
        presence_penalty=0.4,
        repetition_penalty=1.2,
    ),
    "greedy-min-tokens": SamplingParams(
        max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0.0
    ),
    # a structured output: the resumed request's matcher replays the earlier tokens
    "seeded-grammar": SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.9, seed=99, grammar=GrammarSpec("regex", "[a-z ]{300}")
    ),
}


def _run(core: EngineCore, prompt: list[int], params: SamplingParams,
         priors: dict[str, list[int]]) -> dict[str, list[int]]:  # fmt: skip
    """Each request id's tokens generated after its prior output, all in one batch (float32
    is batch invariant: a request's tokens do not depend on what shares its steps)."""
    for request_id, prior in priors.items():
        core.add_request(request_id, prompt, params, prior)
    tokens: dict[str, list[int]] = {request_id: [] for request_id in priors}
    while core.has_unfinished:
        for output in core.step():
            tokens[output.update.request_id].extend(output.update.new_token_ids)
    return tokens


# greedy-min-tokens is slow: the seeded kinds carry more state across the move
@pytest.mark.parametrize(
    "kind",
    [
        # seeded-grammar (the default suite's) resumes a seeded request's state and a
        # matcher's; the others resume parts of it
        kind if kind == "seeded-grammar" else pytest.param(kind, marks=pytest.mark.slow)
        for kind in sorted(PARAMS)
    ],
)
def test_a_resumed_request_goes_on_as_if_it_had_never_moved(
    default_checkpoint_fp32: LoadedCheckpoint, kind: str
) -> None:
    llm = make_llm(default_checkpoint_fp32)
    core = llm.engine
    prompt = llm.encode_prompt(PROMPT_TEXT)
    params = PARAMS[kind]
    whole = _run(core, prompt, params, {"whole": []})["whole"]
    assert len(whole) == MAX_TOKENS  # no EOS inside: every cut below resumes something
    cuts = (1, 7, MAX_TOKENS - 1)
    rests = _run(core, prompt, params, {f"from-{cut}": whole[:cut] for cut in cuts})
    for cut in cuts:
        assert whole[:cut] + rests[f"from-{cut}"] == whole, cut
    assert_no_leaks(llm)


def test_prior_output_is_checked(default_checkpoint_fp32: LoadedCheckpoint) -> None:
    core = make_llm(default_checkpoint_fp32).engine
    params = SamplingParams(max_tokens=4)
    vocab = core.model_config.vocab_size
    with pytest.raises(InvalidRequestError, match="prior output token ids"):
        core.add_request("bad-id", [1, 2, 3], params, [vocab])
    with pytest.raises(InvalidRequestError, match="nothing of max_tokens"):
        core.add_request("used-up", [1, 2, 3], params, [5, 6, 7, 8])
    assert not core.has_unfinished
