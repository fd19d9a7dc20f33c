"""Beam search (``client/beam_search.py``, vLLM's ``use_beam_search``): the search on a toy model
whose every sequence's log-probability is known (against exhaustive enumeration, greedy, and
its stop rules), the gateway's refusals, and, through the float32 cluster's gateway
(``tests/test_serving_integration.py`` calls ``assert_beam_search_served``), the same beams as
the search run over the in-process engine."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
from collections.abc import Sequence

import httpx
import openai
import pytest

from splitserve.client import AsyncClient
from splitserve.client.beam_search import Beam, BeamResult, BeamSearchParams, search
from splitserve.common.errors import InvalidRequestError
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.llm import LLM
from tests.cluster import Served
from tests.gateway_support import (
    _model,
    sdk_fixture,  # noqa: F401 - the fixture sdk, found here by pytest
    served_fixture,  # noqa: F401 - the fixture served, found here by pytest
)

EOS = 3
VOCAB = 4


def toy_logprobs(sequence: Sequence[int]) -> list[float]:
    """A fixed next-token distribution over ``VOCAB`` tokens for each sequence (token ``EOS``
    ends): a function of the sequence alone, so every path's log-probability is known."""
    draw = random.Random(repr(tuple(sequence)))  # a str seed: the same on every run
    weights = [0.2 + draw.random() for _ in range(VOCAB)]  # no two alike
    total = sum(weights)
    return [math.log(weight / total) for weight in weights]


async def toy_next_tokens(sequence: Sequence[int], count: int) -> list[tuple[int, float]]:
    logprobs = toy_logprobs(sequence)
    ranked = sorted(range(VOCAB), key=lambda token: (-logprobs[token], token))
    return [(token, logprobs[token]) for token in ranked[:count]]


def run_toy(params: BeamSearchParams, prompt: Sequence[int] = (9,)) -> list[Beam]:
    return asyncio.run(search(prompt, params, [EOS], toy_next_tokens))


def enumerate_all(prompt: Sequence[int], max_tokens: int) -> list[Beam]:
    """Every sequence the search may end with: stopped at an EOS, or of ``max_tokens``."""
    ended = []
    for length in range(1, max_tokens + 1):
        for body in itertools.product([t for t in range(VOCAB) if t != EOS], repeat=length - 1):
            for last in range(VOCAB):
                tokens = (*body, last)
                if len(tokens) < max_tokens and last != EOS:
                    continue
                logprob = sum(
                    toy_logprobs([*prompt, *tokens[:i]])[tokens[i]] for i in range(len(tokens))
                )
                stop = EOS if last == EOS else None
                ended.append(Beam(tokens, logprob, "stop" if stop else "length", stop))
    return ended


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_a_wide_enough_beam_finds_the_best_sequence_of_all(length_penalty: float) -> None:
    """Width 9 (18 candidates of 4 tokens) keeps every live sequence of 3 tokens: the search
    is exhaustive, so its beams are the best of all sequences by score, in order."""
    params = BeamSearchParams(width=9, max_tokens=3, length_penalty=length_penalty)
    beams = run_toy(params)
    every = sorted(enumerate_all((9,), 3), key=lambda b: b.score(length_penalty), reverse=True)
    assert [b.token_ids for b in beams] == [b.token_ids for b in every[:9]]
    for beam, expected in zip(beams, every, strict=False):
        assert beam.logprob == pytest.approx(expected.logprob)
        assert beam.finish_reason == expected.finish_reason


def test_width_one_is_greedy_and_wider_beams_are_no_worse() -> None:
    greedy: list[int] = []
    for _ in range(4):
        logprobs = toy_logprobs([9, *greedy])
        token = max(range(VOCAB), key=lambda t: (logprobs[t], -t))
        greedy.append(token)
        if token == EOS:
            break
    [beam] = run_toy(BeamSearchParams(width=1, max_tokens=4))
    assert list(beam.token_ids) == greedy
    for width in (2, 3, 5):
        best = run_toy(BeamSearchParams(width=width, max_tokens=4))[0]
        assert best.score(1.0) >= beam.score(1.0) - 1e-12


def test_stops_min_tokens_and_ignore_eos() -> None:
    params = BeamSearchParams(width=4, max_tokens=5, min_tokens=3, stop_token_ids=(2,))
    for beam in run_toy(params):
        if beam.finish_reason == "stop":
            assert beam.stop_token_id in (EOS, 2) and len(beam.token_ids) >= 4
            assert not {EOS, 2} & set(beam.token_ids[:-1])
        else:
            assert len(beam.token_ids) == 5 and not {EOS, 2} & set(beam.token_ids)
    for beam in run_toy(BeamSearchParams(width=3, max_tokens=4, ignore_eos=True)):
        assert beam.finish_reason == "length" and len(beam.token_ids) == 4


def test_the_parameters_are_checked() -> None:
    for kwargs, param in (
        ({"width": 0, "max_tokens": 4}, "n"),
        ({"width": 11, "max_tokens": 4}, "n"),
        ({"width": 2, "max_tokens": 0}, "max_tokens"),
        ({"width": 2, "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"width": 2, "max_tokens": 4, "length_penalty": 50.0}, "length_penalty"),
    ):
        with pytest.raises(InvalidRequestError) as refused:
            BeamSearchParams(**kwargs)
        assert refused.value.param == param


def engine_next_tokens(llm: LLM):
    """``NextTokens`` over an in-process engine: one token, greedy, ``count`` logprobs."""

    async def next_tokens(sequence: Sequence[int], count: int) -> list[tuple[int, float]]:
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=count, ignore_eos=True)
        [output] = llm.generate([list(sequence)], params)
        return list(output.logprobs[0].top)

    return next_tokens


def assert_beam_search_served(gateway_url: str, llm: LLM) -> None:
    """Through the gateway of a float32 cluster: completions with ``use_beam_search`` give the
    beams the search gives over the in-process float32 engine, token for token, best first,
    whole and streamed; chat too."""
    prompt = "The three primary colors are"
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0) as sdk:
        _assert_beams_served(gateway_url, sdk, llm, prompt)


def _assert_beams_served(gateway_url: str, sdk: openai.OpenAI, llm: LLM, prompt: str) -> None:
    model = sdk.models.list().data[0].id
    ids = llm.engine.tokenizer.encode(prompt, False)
    params = BeamSearchParams(width=3, max_tokens=6, length_penalty=0.5)
    expected = asyncio.run(
        search(ids, params, sorted(llm.engine.eos_token_ids), engine_next_tokens(llm))
    )
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "n": 3, "use_beam_search": True,
            "length_penalty": 0.5, "return_token_ids": True}  # fmt: skip
    answer = httpx.post(f"{gateway_url}/v1/completions", json=body, timeout=120).json()
    choices = sorted(answer["choices"], key=lambda choice: choice["index"])
    assert [tuple(c["token_ids"]) for c in choices] == [b.token_ids for b in expected]
    assert [c["finish_reason"] for c in choices] == [b.finish_reason for b in expected]
    tokenizer = llm.engine.tokenizer
    assert [c["text"] for c in choices] == [tokenizer.decode(b.token_ids) for b in expected]
    assert answer["usage"]["completion_tokens"] == sum(len(b.token_ids) for b in expected)
    streamed = sdk.completions.create(
        model=model, prompt=prompt, max_tokens=6, n=3, stream=True,
        extra_body={"use_beam_search": True, "length_penalty": 0.5},
    )  # fmt: skip
    texts = ["", "", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c["text"] for c in choices]
    chat = sdk.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a color."}], max_tokens=5,
        n=2, extra_body={"use_beam_search": True},
    )  # fmt: skip
    assert len(chat.choices) == 2 and chat.choices[0].message.content
    assert chat.choices[0].message.content != chat.choices[1].message.content


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": 0.8}, "temperature"),
        ({"top_p": 0.9}, "top_p"),
        ({"stop": ["x"]}, "stop"),
        ({"logprobs": 2}, "logprobs"),
        ({"n": 11}, "n"),
        ({"n": 2, "best_of": 3}, "best_of"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_beam_search_refuses_what_it_does_not_take(
    served: Served, sdk: openai.OpenAI, extra: dict[str, object], param: str
) -> None:
    body = {"model": _model(sdk), "prompt": "Hi", "max_tokens": 2, "use_beam_search": True,
            **extra}  # fmt: skip
    refused = httpx.post(f"{served.url}/v1/completions", json=body, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    lone = httpx.post(
        f"{served.url}/v1/completions",
        json={"model": _model(sdk), "prompt": "Hi", "max_tokens": 2, "length_penalty": 0.5},
        timeout=30,
    )
    assert lone.status_code == 400 and lone.json()["error"]["param"] == "length_penalty"


def test_the_python_client_searches_beams_over_grpc(served: Served) -> None:
    """``AsyncClient.beam_search``: ``n`` beams, best first by score, each with its text."""

    async def body() -> tuple[list[BeamResult], str]:
        async with AsyncClient(served.coordinator) as client:
            params = BeamSearchParams(width=3, max_tokens=5)
            results = await client.beam_search("The capital of France is", params=params)
            return results, await client.detokenize(results[0].beam.token_ids,
                                                    skip_special_tokens=True)  # fmt: skip

    results, first_text = asyncio.run(body())
    assert len(results) == 3 and len({r.beam.token_ids for r in results}) == 3
    scores = [r.beam.score(1.0) for r in results]
    assert scores == sorted(scores, reverse=True)
    assert results[0].text == first_text and all(r.text for r in results)
    assert all(r.beam.finish_reason in ("stop", "length") for r in results)
