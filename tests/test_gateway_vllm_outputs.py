"""vLLM's output options through the gateway of a real cluster (the shared ``served_cluster``):
``include_stop_str_in_output`` (the stop string stays at the text's end) and
``return_tokens_as_token_ids`` (logprobs name tokens ``token_id:<id>``), whole and streamed,
on completions and chat."""

from __future__ import annotations

import httpx
import openai

from tests.cluster import Served
from tests.gateway_support import (
    QUESTION,
    _model,
    sdk_fixture,  # noqa: F401 - the fixture sdk, found here by pytest
    served_fixture,  # noqa: F401 - the fixture served, found here by pytest
)

PROMPT = "List the days of the week: Monday, Tuesday,"


def test_an_included_stop_string_ends_the_text(served: Served, sdk: openai.OpenAI) -> None:
    model = _model(sdk)
    plain = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    text = plain.choices[0].text
    stop = text.strip().split()[1]  # a word the greedy continuation writes, not its first
    cut = sdk.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop]
    )
    kept = sdk.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
        extra_body={"include_stop_str_in_output": True},
    )  # fmt: skip
    assert cut.choices[0].text == text[: text.index(stop)]
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)]
    assert kept.choices[0].finish_reason == "stop" and kept.choices[0].stop_reason == stop
    streamed = sdk.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=12, temperature=0, stream=True,
        stop=["Paris"], extra_body={"include_stop_str_in_output": True},
    )  # fmt: skip
    content = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert content.endswith("Paris") and content.count("Paris") == 1


def test_logprobs_name_tokens_by_id_when_asked(served: Served, sdk: openai.OpenAI) -> None:
    model = _model(sdk)
    asked = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
             "logprobs": 2, "echo": True}  # fmt: skip
    by_text = httpx.post(f"{served.url}/v1/completions", json=asked, timeout=60).json()
    by_id = httpx.post(
        f"{served.url}/v1/completions",
        json={**asked, "return_tokens_as_token_ids": True},
        timeout=60,
    ).json()
    ids = httpx.post(
        f"{served.url}/tokenize", json={"prompt": by_text["choices"][0]["text"]}, timeout=30
    ).json()["tokens"]
    named = by_id["choices"][0]["logprobs"]
    assert named["tokens"] == [f"token_id:{token}" for token in ids]
    assert all(key.startswith("token_id:") for top in named["top_logprobs"][1:] for key in top)
    assert named["token_logprobs"] == by_text["choices"][0]["logprobs"]["token_logprobs"]
    assert by_id["choices"][0]["text"] == by_text["choices"][0]["text"]
    chat = sdk.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=3, temperature=0, logprobs=True,
        top_logprobs=1, stream=True, extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    entries = [e for c in chat if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]  # fmt: skip
    assert len(entries) == 3
    assert all(e.token.startswith("token_id:") and e.bytes == list(e.token.encode())
               for e in entries)  # fmt: skip
