"""Prompt logprobs through the gateway of a real cluster (the shared ``served_cluster``, bf16):
completions' ``echo`` with ``logprobs`` (the prompt's tokens lead the logprobs, whole and
streamed) and vLLM's ``prompt_logprobs`` on completions and chat, driven by the ``openai``
SDK and raw HTTP. Their values against a float32 reference are checked on the float32
cluster (``test_serving_integration.py``) and in the engine (``test_prompt_logprobs.py``);
here: their shape, that every form carries the same records, and the refusals."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from splitserve.gateway.schemas import ChatCompletionResponse, CompletionResponse
from tests.cluster import Served
from tests.gateway_support import (
    QUESTION,
    _error,
    _model,
    sdk_fixture,  # noqa: F401 - the fixture sdk, found here by pytest
    served_fixture,  # noqa: F401 - the fixture served, found here by pytest
)

PROMPT = "The lighthouse keeper climbed the stairs"


def _ids(served: Served, body: dict[str, Any]) -> list[int]:
    return httpx.post(f"{served.url}/tokenize", json=body, timeout=30).json()["tokens"]


def _assert_vllm_form(positions: list[Any], prompt: list[int], top: int) -> list[float]:
    """vLLM's ``prompt_logprobs``: null first, then each position holding its prompt token
    (its rank) and its ``top`` alternatives ranked 1..top; the prompt tokens' logprobs."""
    assert positions[0] is None and len(positions) == len(prompt)
    logprobs = []
    for position, token in zip(positions[1:], prompt[1:], strict=True):
        own = position[str(token)]
        ranked = sorted((entry["rank"], entry["logprob"]) for entry in position.values())
        assert len(position) in (top, top + 1) and own["rank"] >= 1 and own["logprob"] <= 0
        assert [rank for rank, _ in ranked][:top] == list(range(1, top + 1))
        assert [value for _, value in ranked[:top]] == sorted(
            (value for _, value in ranked[:top]), reverse=True
        )
        assert ranked[0][1] >= own["logprob"] and isinstance(own["decoded_token"], str)
        logprobs.append(own["logprob"])
    return logprobs


def test_echo_with_logprobs_leads_with_the_prompt_whole_and_streamed(
    served: Served, sdk: openai.OpenAI
) -> None:
    """lm-evaluation-harness's loglikelihood payload (token ids, ``echo``, ``logprobs=1``,
    one token), then the same streamed: the first chunk echoes the prompt with its logprobs."""
    model, prompt = _model(sdk), _ids(served, {"prompt": PROMPT})
    asked = {"model": model, "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 3,
             "temperature": 0}  # fmt: skip
    whole = sdk.completions.create(**asked)
    CompletionResponse.model_validate(whole.model_dump())
    logprobs = whole.choices[0].logprobs
    assert len(logprobs.tokens) == len(prompt) + 3
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(value <= 0 for value in logprobs.token_logprobs[1:])
    assert all(len(alternatives) == 1 for alternatives in logprobs.top_logprobs[1:])
    assert "".join(logprobs.tokens[: len(prompt)]) == PROMPT
    assert logprobs.text_offset[: len(prompt)] == [
        len("".join(logprobs.tokens[:i])) for i in range(len(prompt))
    ]
    assert whole.choices[0].text.startswith(PROMPT)

    chunks = list(sdk.completions.create(**asked, stream=True))
    first = chunks[0].choices[0]
    assert first.text == PROMPT and first.logprobs.tokens == logprobs.tokens[: len(prompt)]
    streamed = [value for c in chunks for ch in c.choices if ch.logprobs
                for value in ch.logprobs.token_logprobs]  # fmt: skip
    assert streamed == logprobs.token_logprobs
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text

    # vLLM's form carries the same records (and the usage says none came from a cache)
    vllm = httpx.post(
        f"{served.url}/v1/completions",
        json={
            "model": model,
            "prompt": prompt,
            "prompt_logprobs": 2,
            "max_tokens": 1,
            "temperature": 0,
        },  # fmt: skip
        timeout=60,
    ).json()
    CompletionResponse.model_validate(vllm)
    values = _assert_vllm_form(vllm["choices"][0]["prompt_logprobs"], prompt, 2)
    assert values == logprobs.token_logprobs[1 : len(prompt)]
    assert vllm["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_chat_prompt_logprobs_cover_the_templated_prompt_for_every_choice(
    served: Served, sdk: openai.OpenAI
) -> None:
    model = _model(sdk)
    prompt = _ids(served, {"messages": QUESTION})
    answer = sdk.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=2, temperature=0, n=2,
        extra_body={"prompt_logprobs": 0},
    )  # fmt: skip
    body = answer.model_dump()
    ChatCompletionResponse.model_validate(body)
    _assert_vllm_form(body["prompt_logprobs"], prompt, 0)
    assert answer.usage.prompt_tokens == len(prompt)


def test_prompt_logprobs_refusals_name_the_field(served: Served, sdk: openai.OpenAI) -> None:
    """Not streamed (as in vLLM), bounded like ``logprobs``, and not on the Responses API
    (a response has no place for them)."""
    model = _model(sdk)
    refused = [
        ("/v1/chat/completions", {"messages": QUESTION, "stream": True, "prompt_logprobs": 1}),
        ("/v1/completions", {"prompt": PROMPT, "stream": True, "prompt_logprobs": 0}),
        ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 21}),
        ("/v1/responses", {"input": PROMPT, "prompt_logprobs": 1}),
    ]
    for route, body in refused:
        response = httpx.post(f"{served.url}{route}", json={"model": model, **body}, timeout=30)
        assert _error(response, 400)["param"] == "prompt_logprobs", (route, response.text)


@pytest.mark.parametrize("top", [0, 5])
def test_echo_logprobs_show_as_many_alternatives_as_asked(
    served: Served, sdk: openai.OpenAI, top: int
) -> None:
    """With ``echo``, each prompt token shows ``logprobs`` alternatives, also when
    ``prompt_logprobs`` asks for more in the same request."""
    answer = httpx.post(
        f"{served.url}/v1/completions",
        json={
            "model": _model(sdk),
            "prompt": PROMPT,
            "echo": True,
            "logprobs": top,
            "prompt_logprobs": 6,
            "max_tokens": 1,
            "temperature": 0,
        },  # fmt: skip
        timeout=60,
    ).json()
    choice = answer["choices"][0]
    assert all(len(alts) == top for alts in choice["logprobs"]["top_logprobs"][1:])
    assert all(len(position) >= 6 for position in choice["prompt_logprobs"][1:])
