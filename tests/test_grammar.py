"""Structured outputs (``common/grammar.py``, ``engine/grammar_matchers.py``, the sampler's
mask): constraints parse or are refused naming ``structured_outputs``; a matcher's mask is
the grammar's state after exactly the request's output tokens, however they arrived; the
in-process engine's outputs match their constraint."""

from __future__ import annotations

import json
import re

import pytest
import torch

from splitserve.common.errors import InvalidRequestError
from splitserve.common.grammar import GrammarCompiler, GrammarSpec
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.checkpoint import LoadedCheckpoint
from splitserve.engine.grammar_matchers import GrammarMatchers
from splitserve.engine.sampler import Sampler, SamplingRow
from tests.conftest import assert_no_leaks, make_llm

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec("regex", "(unclosed"),
        GrammarSpec("json_schema", "{not json"),
        GrammarSpec("choice", "[]"),
        GrammarSpec("grammar", "start: undefined_rule"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_by_name(
    compiler: GrammarCompiler, spec: GrammarSpec
) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        compiler.compile(spec)
    assert refused.value.param == "structured_outputs"


def test_unknown_kinds_and_bad_choices_are_refused_on_construction() -> None:
    for make in (lambda: GrammarSpec("yaml", ""), lambda: GrammarSpec.choice([1, 2])):
        with pytest.raises(InvalidRequestError) as refused:
            make()
        assert refused.value.param == "structured_outputs"


def test_the_mask_follows_the_output_tokens_however_they_arrived(
    compiler: GrammarCompiler, default_checkpoint_fp32: LoadedCheckpoint
) -> None:
    """One matcher fed token by token and one fed all at once (a request that arrives with
    its first tokens, as on a decode worker or after a resume) give the same masks; the
    mask holds the next token of a valid output and, once the grammar is complete, only EOS."""
    tokenizer = default_checkpoint_fp32.tokenizer
    vocab = default_checkpoint_fp32.config.vocab_size
    spec = GrammarSpec.choice(["yes", "no way"])
    ids = tokenizer.encode("no way")
    stepwise, at_once = GrammarMatchers(compiler, vocab), GrammarMatchers(compiler, vocab)
    for k in range(len(ids)):
        mask = stepwise.allowed("r", spec, ids[:k], {0})
        assert mask[ids[k]]
    late = at_once.allowed("r", spec, ids[:-1], {0})
    assert torch.equal(late, stepwise.allowed("r", spec, ids[:-1], {0}))
    done = stepwise.allowed("r", spec, ids, {0})
    assert done.nonzero().flatten().tolist() == [0]  # only EOS once complete
    stepwise.free("r")


def test_the_sampler_takes_only_allowed_tokens() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0]])
    allowed = torch.tensor([False, False, True, True])
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1)):
        row = SamplingRow(params, None, [], [], frozenset(), allowed_token_mask=allowed)
        tokens = {Sampler()(logits, [row]).token_ids[0] for _ in range(20)}
        assert tokens <= {2, 3}


def test_a_complete_grammar_ends_the_request_even_below_min_tokens() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0]])
    only_eos = torch.tensor([False, False, False, True])
    params = SamplingParams(temperature=0.0, min_tokens=10)
    row = SamplingRow(params, None, [], [], frozenset({3}), allowed_token_mask=only_eos)
    assert Sampler()(logits, [row]).token_ids == [3]


def test_the_engine_output_matches_each_constraint(
    default_checkpoint_fp32: LoadedCheckpoint,
) -> None:
    llm = make_llm(default_checkpoint_fp32)
    prompt = "Describe a person as JSON:"
    cases = [
        (GrammarSpec.json_schema(SCHEMA), lambda text: set(json.loads(text)) == {"name", "n"}),
        (GrammarSpec("regex", "[0-9]{3}-[a-z]{2}"), re.compile("[0-9]{3}-[a-z]{2}").fullmatch),
        (GrammarSpec.choice(["yes", "no"]), {"yes", "no"}.__contains__),
    ]
    for spec, holds in cases:
        params = SamplingParams(max_tokens=48, temperature=0.7, seed=3, grammar=spec)
        (result,) = llm.generate([prompt], params)
        assert result.finish_reason.value == "stop" and holds(result.text), (spec, result.text)
    assert_no_leaks(llm)
