"""Structured outputs and tool calls through the OpenAI-compatible gateway of a real cluster
(the shared ``served_cluster``, as in ``test_gateway.py``), driven by the official ``openai``
SDK and raw HTTP, and tool calls through the Python client over gRPC: every output matches its
constraint, whole and streamed, and a constraint or a tool that does not compile is a 400
naming its field."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from splitserve.client import Client, Sampling
from splitserve.common.errors import InvalidRequestError
from tests.cluster import Served
from tests.gateway_support import (
    QUESTION,
    _error,
    _model,
    sdk_fixture,  # noqa: F401 - the fixture sdk, found here by pytest
    served_fixture,  # noqa: F401 - the fixture served, found here by pytest
)


class City(BaseModel):
    city: str = Field(max_length=16)
    country: str = Field(max_length=16)


def test_structured_outputs_parse_on_every_field_that_asks(
    served: Served, sdk: openai.OpenAI
) -> None:
    """OpenAI's response_format (the SDK's parse with a pydantic model, json_object), vLLM's
    guided_regex / guided_choice and structured_outputs: each output matches; streamed too;
    a constraint that does not compile, or two at once, is a 400 naming the field."""
    model = _model(sdk)
    parsed = sdk.beta.chat.completions.parse(
        model=model, messages=QUESTION, response_format=City, max_tokens=60, temperature=0
    )
    assert isinstance(parsed.choices[0].message.parsed, City)
    regex = sdk.completions.create(
        model=model, prompt="A phone number:", max_tokens=20, temperature=0,
        extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"},
    )  # fmt: skip
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", regex.choices[0].text)
    assert regex.choices[0].finish_reason == "stop"
    choice = sdk.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=10, temperature=0.8, seed=5,
        extra_body={"guided_choice": ["Paris", "Lyon", "Nice"]},
    )  # fmt: skip
    assert choice.choices[0].message.content in {"Paris", "Lyon", "Nice"}
    stream = sdk.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=80, temperature=0, stream=True,
        extra_body={"structured_outputs": {"json": City.model_json_schema()}},
    )  # fmt: skip
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert City.model_validate_json(text)
    ask = [{"role": "user", "content": 'Reply with the JSON object {"ok": true} and nothing else.'}]
    any_object = sdk.chat.completions.create(
        model=model, messages=ask, max_tokens=100, temperature=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert isinstance(json.loads(any_object.choices[0].message.content), dict)
    with httpx.Client(base_url=f"{served.url}/v1", timeout=30) as http:
        bad = http.post("/completions", json={"prompt": "x", "guided_regex": "(unclosed"})
        assert _error(bad, 400)["param"] == "structured_outputs"
        two = http.post(
            "/completions", json={"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}
        )
        assert _error(two, 400)["param"] == "guided_choice"


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}


def test_the_python_client_calls_tools_as_the_gateway_does(
    served: Served, sdk: openai.OpenAI
) -> None:
    """``Client.generate(tools=...)`` over gRPC shares the gateway's tool plan
    (``client/tools.py``): the same forced greedy call, name and arguments, as the openai SDK
    gets through the gateway; malformed tools are refused before anything is sent."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    over_http = sdk.chat.completions.create(
        model=_model(sdk), messages=ask, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, max_tokens=100, temperature=0,
    ).choices[0]  # fmt: skip
    with Client(served.coordinator) as client:
        over_grpc = client.generate(
            messages=ask, tools=[WEATHER, TIME], tool_choice="required",
            parallel_tool_calls=False, sampling=Sampling(max_tokens=100, temperature=0),
        )  # fmt: skip
        assert over_grpc.finish_reason == "tool_calls" == over_http.finish_reason
        assert [(c.name, json.loads(c.arguments)) for c in over_grpc.tool_calls] == [
            (c.function.name, json.loads(c.function.arguments))
            for c in over_http.message.tool_calls or []
        ]
        free = client.generate(
            messages=ask, tools=[WEATHER], tool_choice="none",
            sampling=Sampling(max_tokens=4, temperature=0),
        )  # fmt: skip
        assert free.tool_calls == () and free.finish_reason == "length"
        with pytest.raises(InvalidRequestError) as refused:
            client.generate(messages=ask, tools=[{"type": "function", "function": {"name": "a b"}}])
        assert refused.value.param == "tools"


def test_tool_calls_forced_by_the_grammar_whole_and_streamed(
    served: Served, sdk: openai.OpenAI
) -> None:
    model = _model(sdk)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = sdk.chat.completions.create(
        model=model, messages=ask, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, max_tokens=100, temperature=0,
    )  # fmt: skip
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and {call.function.name for call in calls} <= {"get_weather", "get_time"}
    for call in calls:
        arguments = json.loads(call.function.arguments)
        assert set(arguments) == ({"city"} if call.function.name == "get_weather" else set())
    named = sdk.chat.completions.create(
        model=model, messages=ask, tools=[WEATHER, TIME], max_tokens=100, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, stream=True,
    )  # fmt: skip
    streamed: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in named:
        for delta_call in chunk.choices[0].delta.tool_calls or []:
            entry = streamed.setdefault(delta_call.index, {"name": "", "arguments": ""})
            entry["name"] += delta_call.function.name or ""
            entry["arguments"] += delta_call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and [c["name"] for c in streamed.values()] == ["get_time"]
    assert json.loads(streamed[0]["arguments"]) == {}
    # the call and its result go back into the conversation
    made = {"name": calls[0].function.name, "arguments": calls[0].function.arguments}
    history = [
        *ask,
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": calls[0].id, "type": "function", "function": made}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "Sunny, 21 C"},
    ]  # fmt: skip
    answer = sdk.chat.completions.create(
        model=model, messages=history, tools=[WEATHER], max_tokens=8, temperature=0
    )
    assert answer.choices[0].finish_reason in {"stop", "length", "tool_calls"}
    with httpx.Client(base_url=f"{served.url}/v1", timeout=30) as http:
        for field, value in (
            ("tools", [{"type": "function", "function": {"name": "a b"}}]),
            ("tool_choice", {"type": "function", "function": {"name": "x"}}),
        ):
            body = {"messages": ask, "tools": [WEATHER], field: value}
            assert _error(http.post("/chat/completions", json=body), 400)["param"] == field


def test_streamed_tool_calls_arrive_as_deltas_that_join_to_the_whole_call(
    served: Served, sdk: openai.OpenAI
) -> None:
    """A streamed call's first delta carries its index, id, type and name, the later ones
    only pieces of its arguments, several as the tokens arrive; joined they are exactly the
    non-streamed call's arguments, and the SDK's stream helper reassembles the same call. The
    call's id goes back with the history: the prompt the model then reads holds it."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    request = {
        "model": _model(sdk), "messages": ask, "tools": [WEATHER, TIME],
        "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 100,
        "temperature": 0,
    }  # fmt: skip
    whole = sdk.chat.completions.create(**request).choices[0].message.tool_calls or []
    assert len(whole) == 1 and json.loads(whole[0].function.arguments)
    stream = sdk.chat.completions.create(**request, stream=True)
    deltas = [call for chunk in stream for c in chunk.choices for call in c.delta.tool_calls or []]
    first, *later = deltas
    assert (first.index, first.type, first.function.name) == (0, "function", "get_weather")
    assert first.id and first.id.startswith("call_")
    assert later and all(d.index == 0 and d.id is None and d.type is None for d in later)
    assert all(d.function.name is None for d in later)
    assert sum(1 for d in deltas if d.function.arguments) >= 2  # in pieces, not whole
    joined = "".join(d.function.arguments or "" for d in deltas)
    assert joined == whole[0].function.arguments
    with sdk.chat.completions.stream(**request) as helper:
        final = helper.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls or []] == [
        (whole[0].function.name, whole[0].function.arguments)
    ]
    made = {"name": "get_weather", "arguments": joined}
    history = [
        *ask,
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": first.id, "type": "function", "function": made}]},
        {"role": "tool", "tool_call_id": first.id, "content": "Sunny, 21 C"},
    ]  # fmt: skip
    with httpx.Client(base_url=served.url, timeout=30) as http:
        ids = http.post("/tokenize", json={"messages": history}).json()["tokens"]
        prompt = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert prompt.count(first.id) == 2  # the call and the result that answers it


def test_chat_best_of_returns_the_candidates_with_the_highest_logprob(
    served: Served, sdk: openai.OpenAI
) -> None:
    """Chat's ``best_of`` is served as completions' is: candidate j samples with seed + j,
    the ``n`` with the highest cumulative logprob return, best first, without logprobs
    unless asked; it is not streamed above ``n`` and never below it."""
    model = _model(sdk)
    sampled = {"model": model, "messages": QUESTION, "max_tokens": 6, "temperature": 1.0}
    best = sdk.chat.completions.create(**sampled, n=2, seed=11, extra_body={"best_of": 3})
    candidates = [
        sdk.chat.completions.create(**sampled, seed=11 + j, logprobs=True).choices[0]
        for j in range(3)
    ]
    ranked = sorted(candidates, key=lambda c: -sum(t.logprob for t in c.logprobs.content))
    assert [c.message.content for c in best.choices] == [c.message.content for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    with httpx.Client(base_url=f"{served.url}/v1", timeout=30) as http:
        for extra in ({"best_of": 2, "stream": True}, {"best_of": 1, "n": 2}):
            body = {"messages": QUESTION, "max_tokens": 2, **extra}
            assert _error(http.post("/chat/completions", json=body), 400)["param"] == "best_of"


STRUCTURAL_TAG = {
    "type": "structural_tag",
    "format": {
        "type": "sequence",
        "elements": [
            {"type": "const_string", "value": "Weather: "},
            {
                "type": "tag",
                "begin": "<call>",
                "content": {"type": "json_schema", "json_schema": City.model_json_schema()},
                "end": "</call>",
            },
        ],
    },
}


def test_structural_tags_constrain_whole_and_streamed_outputs(
    served: Served, sdk: openai.OpenAI
) -> None:
    """A structural tag as OpenAI's response_format (xgrammar's form) and as vLLM's
    structured_outputs.structural_tag (its JSON text, vLLM's structures and triggers): the
    output has the form, whole and streamed alike; a form not served is a 400 naming the
    field it came in."""
    model = _model(sdk)
    shape = re.compile(r"Weather: <call>(\{.*\})</call>")
    whole = sdk.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=60, temperature=0,
        response_format=STRUCTURAL_TAG,  # type: ignore[arg-type]
    )  # fmt: skip
    text = whole.choices[0].message.content or ""
    assert whole.choices[0].finish_reason == "stop" and shape.fullmatch(text), text
    City.model_validate_json(shape.fullmatch(text).group(1))  # type: ignore[union-attr]
    stream = sdk.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=60, temperature=0, stream=True,
        response_format=STRUCTURAL_TAG,  # type: ignore[arg-type]
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    legacy = {
        "type": "structural_tag",
        "structures": [{"begin": "<call>", "schema": City.model_json_schema(), "end": "</call>"}],
        "triggers": ["<call>"],
    }
    with httpx.Client(base_url=f"{served.url}/v1", timeout=60) as http:
        answered = http.post("/completions", json={
            "model": model, "prompt": "Call the weather tool for Rome: <call>", "max_tokens": 40,
            "temperature": 0, "structured_outputs": {"structural_tag": json.dumps(legacy)},
        })  # fmt: skip
        assert answered.status_code == 200, answered.text
        completion = answered.json()["choices"][0]["text"]
        for call in re.findall(r"<call>(.*?)</call>", completion):
            City.model_validate_json(call)
        token = {"type": "structural_tag", "format": {"type": "token", "token": "<x>"}}
        refused = http.post("/completions", json={"prompt": "x", "response_format": token})
        assert _error(refused, 400)["param"] == "response_format"
        assert "token format is not supported" in refused.json()["error"]["message"]
        top_level = http.post("/completions", json={"prompt": "x", "structural_tag": "{}"})
        assert _error(top_level, 400)["param"] == "structural_tag"
