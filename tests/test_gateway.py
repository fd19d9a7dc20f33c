"""The OpenAI-compatible gateway against a real cluster (the shared ``served_cluster``,
``splitserve up``: coordinator, 1 prefill + 1 decode worker, gateway), driven by the official
``openai`` SDK and raw HTTP. Structured outputs and tool calls: ``test_gateway_structured.py``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.client import Client, Sampling
from tests.cluster import (
    SERVED_MAX_INFLIGHT,
    Served,
    assert_all_free,
    wait_until_idle,
    worker_loads,
)
from tests.gateway_support import (
    QUESTION,
    _error,
    _model,
    assert_route_schema,
    sdk_fixture,  # noqa: F401 - the fixture sdk, found here by pytest
    served_fixture,  # noqa: F401 - the fixture served, found here by pytest
)

MAX_INFLIGHT = SERVED_MAX_INFLIGHT


def _samples(url: str) -> dict[str, float]:
    """name{labels} -> value of every sample at a /metrics URL (parsing must succeed)."""
    text = httpx.get(url, timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def _total(samples: dict[str, float], name: str) -> float:
    return sum(value for key, value in samples.items() if key.startswith(name + "{"))


def test_models_health_and_openapi(served: Served, sdk: openai.OpenAI) -> None:
    models = sdk.models.list().data
    assert len(models) == 1 and models[0].id.lower().startswith("smollm2")
    assert httpx.get(f"{served.url}/health", timeout=10).status_code == 200
    schema = httpx.get(f"{served.url}/openapi.json", timeout=10).json()
    assert_route_schema(schema, "/v1/completions", "CompletionRequest", "CompletionResponse")
    assert "429" in schema["paths"]["/v1/completions"]["post"]["responses"]
    chat_fields = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"messages", "max_completion_tokens", "stream_options", "logprobs"} <= set(chat_fields)


def test_chat_streamed_equals_whole_and_grpc_client(served: Served, sdk: openai.OpenAI) -> None:
    model = _model(sdk)
    whole = sdk.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=32, temperature=0
    )
    text = whole.choices[0].message.content
    assert "Paris" in text
    assert whole.choices[0].finish_reason == "stop"
    usage = whole.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.completion_tokens > 0

    chunks = list(
        sdk.chat.completions.create(
            model=model,
            messages=QUESTION,
            max_completion_tokens=32,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == usage.prompt_tokens

    with Client(served.coordinator) as client:
        direct = client.generate(messages=QUESTION, sampling=Sampling(max_tokens=32, temperature=0))
    assert direct.text == text


def test_completions_with_logprobs_stop_and_seed(served: Served, sdk: openai.OpenAI) -> None:
    model = _model(sdk)
    prompt = "The capital of France is"
    whole = sdk.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, logprobs=2
    )
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and whole.usage.completion_tokens == 12
    assert "".join(choice.logprobs.tokens) == choice.text
    assert len(choice.logprobs.token_logprobs) == 12
    assert all(len(top) >= 1 for top in choice.logprobs.top_logprobs)
    assert all(lp <= 0.0 for lp in choice.logprobs.token_logprobs)

    streamed = sdk.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text

    stop_word = choice.text.split()[1] if len(choice.text.split()) > 1 else choice.text.strip()
    stopped = sdk.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, stop=[stop_word]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stop_word not in stopped.choices[0].text

    seeded = [
        sdk.completions.create(
            model=model, prompt=prompt, max_tokens=10, temperature=1.0, seed=1234
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]

    tokens = sdk.completions.create(
        model=model,
        prompt=[1, 2, 3, 4],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert tokens.usage.prompt_tokens == 4 and tokens.usage.completion_tokens == 5


def test_nulls_defaults_and_vllm_extensions(served: Served, sdk: openai.OpenAI) -> None:
    model = _model(sdk)
    with httpx.Client(timeout=60) as http:
        nulls = http.post(
            f"{served.url}/v1/chat/completions",
            json={
                "model": model,
                "messages": QUESTION,
                "max_tokens": 4,
                "stream": None,
                "n": None,
                "logprobs": None,
                "ignore_eos": None,
                "stop": None,
                "user": "someone",
            },
        )
        assert nulls.status_code == 200, nulls.text
        assert nulls.json()["usage"]["completion_tokens"] <= 4
        # no max_tokens and min_tokens above the default of 16: accepted (was refused)
        long = http.post(
            f"{served.url}/v1/chat/completions",
            json={"model": model, "messages": QUESTION, "min_tokens": 20, "stop": ["\n"]},
        )
        assert long.status_code == 200, long.text
    # splitserve's own extension: the request's latency targets for placing its prompt
    targeted = sdk.completions.create(
        model=model,
        prompt="Hello",
        max_tokens=4,
        temperature=0,
        extra_body={"ttft_slo_ms": 500, "tpot_slo_ms": 40.5, "max_queue_wait_ms": 5000},
    )
    assert targeted.usage.completion_tokens == 4
    seeded = [
        sdk.completions.create(model=model, prompt="Hello", max_tokens=6, temperature=1.0, seed=-7)
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]


def test_bad_requests_get_openai_errors(served: Served, sdk: openai.OpenAI) -> None:
    model = _model(sdk)
    url = f"{served.url}/v1"
    with httpx.Client(timeout=30) as http:
        bad_json = http.post(
            f"{url}/chat/completions",
            content=b'{"model": "x", "messages": [',
            headers={"content-type": "application/json"},
        )
        assert _error(bad_json, 400)["code"] == "invalid_json"
        wrong_type = http.post(
            f"{url}/completions", json={"model": model, "prompt": "hi", "max_tokens": "ten"}
        )
        assert _error(wrong_type, 400)["param"] == "max_tokens"
        missing = http.post(f"{url}/chat/completions", json={"model": model})
        assert _error(missing, 400)["param"] == "messages"
        unknown = http.post(
            f"{url}/chat/completions", json={"model": "gpt-17", "messages": QUESTION}
        )
        error = _error(unknown, 404)
        assert error["code"] == "model_not_found" and error["param"] == "model"
        oversize = http.post(
            f"{url}/completions",
            json={"model": model, "prompt": "word " * 9000, "max_tokens": 4},
        )
        assert "context" in str(_error(oversize, 400)["message"])
        refused = (
            ("n", 129),
            ("temperature", -1),
            ("logit_bias", {"five": 1.0}),
            ("logit_bias", {"5": 200.0}),
            ("logit_bias", {str(10**6): 1.0}),  # beyond the vocabulary
            ("ttft_slo_ms", 0),
            ("tpot_slo_ms", -20),
            ("max_queue_wait_ms", 0),
            ("priority", -1),  # vLLM's order: earlier than the default tenant may ask
        )
        for field, value in refused:
            response = http.post(
                f"{url}/completions", json={"model": model, "prompt": "hi", field: value}
            )
            assert _error(response, 400)["param"] == field
        for field, value in (("stream", "maybe"), ("response_format", {"type": "yaml"})):
            response = http.post(
                f"{url}/chat/completions",
                json={"model": model, "messages": QUESTION, field: value},
            )
            assert _error(response, 400)["param"] == field
        too_big_id = http.post(
            f"{url}/completions", json={"model": model, "prompt": [2**32], "max_tokens": 2}
        )
        assert _error(too_big_id, 400)["param"] == "prompt"
        streamed_bad = http.post(
            f"{url}/completions",
            json={"model": model, "prompt": [10**7], "max_tokens": 4, "stream": True},
        )
        assert _error(streamed_bad, 400)["param"] == "prompt"
    with pytest.raises(openai.BadRequestError):
        sdk.chat.completions.create(model=model, messages=QUESTION, top_p=5.0)
    # vLLM's extensions it does not serve are refused by name; other unknown fields are counted
    with pytest.raises(openai.BadRequestError) as unserved:
        sdk.chat.completions.create(
            model=model, messages=QUESTION, extra_body={"guided_whitespace_pattern": " *"}
        )
    assert unserved.value.body["param"] == "guided_whitespace_pattern"
    later = sdk.completions.create(
        model=model, prompt="Hi", max_tokens=2, extra_body={"priority": 3}
    )
    assert later.usage.completion_tokens == 2  # lower urgency is always allowed
    forced = sdk.completions.create(  # token 17 is "!" in the default model's vocabulary
        model=model, prompt="Hi", max_tokens=3, temperature=0, logit_bias={"17": 100}
    )
    assert forced.choices[0].text == "!!!" and forced.usage.completion_tokens == 3
    before = _samples(f"{served.url}/metrics")
    ignored = sdk.completions.create(
        model=model, prompt="Hello", max_tokens=2, extra_body={"store": True, "zzz_made_up": 1}
    )
    assert ignored.usage.completion_tokens == 2
    after = _samples(f"{served.url}/metrics")
    for label in ("store", "other"):
        key = f"splitserve_ignored_request_fields_total{{field={label}}}"
        assert after[key] - before.get(key, 0.0) == 1
    # the server is fine afterwards
    again = sdk.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0)
    assert again.usage.completion_tokens == 3


def test_several_choices_prompts_and_echo(served: Served, sdk: openai.OpenAI) -> None:
    """n > 1 and a list of prompts: choice p * n + j answers prompt p with seed + j, each equal
    to the single-choice request with that seed; usage counts each prompt once; echo returns
    the prompt first (text or token ids); streamed, every choice's chunks carry its index."""
    model = _model(sdk)
    sampled = {"max_tokens": 6, "temperature": 1.0, "seed": 11}
    several = sdk.completions.create(model=model, prompt=["Hello", "The sea is"], n=2, **sampled)
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    singles = [
        sdk.completions.create(model=model, prompt=prompt, **{**sampled, "seed": 11 + j})
        for prompt in ("Hello", "The sea is")
        for j in range(2)
    ]
    assert [c.text for c in several.choices] == [s.choices[0].text for s in singles]
    assert several.usage.prompt_tokens == singles[0].usage.prompt_tokens + (
        singles[2].usage.prompt_tokens
    )
    assert several.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    # best_of: the candidate (seed + j) with the highest cumulative logprob, whole
    best = sdk.completions.create(model=model, prompt="The sea is", best_of=3, **sampled)
    candidates = [
        sdk.completions.create(
            model=model, prompt="The sea is", logprobs=0, **{**sampled, "seed": 11 + j}
        ).choices[0]
        for j in range(3)
    ]
    ranked = max(candidates, key=lambda c: sum(c.logprobs.token_logprobs))
    assert [c.text for c in best.choices] == [ranked.text] and best.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError):
        sdk.completions.create(model=model, prompt="x", best_of=2, stream=True)
    echoed = sdk.completions.create(model=model, prompt="Hello", max_tokens=3, echo=True)
    plain = sdk.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0)
    ids = httpx.post(f"{served.url}/tokenize", json={"prompt": "Hello"}, timeout=30).json()
    echoed_ids = sdk.completions.create(
        model=model, prompt=ids["tokens"], max_tokens=3, temperature=0, echo=True
    )
    assert echoed.choices[0].text.startswith("Hello")
    assert echoed_ids.choices[0].text == "Hello" + plain.choices[0].text
    stream = sdk.chat.completions.create(
        model=model, messages=QUESTION, n=3, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    texts = ["", "", ""]
    finished, usage = set(), None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finished.add(choice.index)
    whole = sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=5, temperature=0)
    assert texts == [whole.choices[0].message.content] * 3 and finished == {0, 1, 2}
    assert usage is not None and usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == 3 * whole.usage.completion_tokens


def test_tokenize_detokenize_and_version_as_vllm_serves_them(
    served: Served, sdk: openai.OpenAI
) -> None:
    model = _model(sdk)
    with httpx.Client(base_url=served.url, timeout=30) as http:
        text = http.post("/tokenize", json={"model": model, "prompt": "Hello world"}).json()
        completion = sdk.completions.create(model=model, prompt="Hello world", max_tokens=1)
        assert text["count"] == len(text["tokens"]) == completion.usage.prompt_tokens
        assert text["max_model_len"] > 0 and text["token_strs"] is None
        chat = http.post("/tokenize", json={"messages": QUESTION}).json()
        answer = sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=1)
        assert chat["count"] == answer.usage.prompt_tokens  # template and generation prompt
        back = http.post("/detokenize", json={"model": model, "tokens": text["tokens"]})
        assert back.json() == {"prompt": "Hello world"}
        assert _error(http.post("/detokenize", json={"tokens": [10**7]}), 400)["param"] == "tokens"
        for beyond_the_wire in (2**31, -1, 10**20):  # once a 500 (the fuzz test found it)
            refused = http.post("/detokenize", json={"tokens": [beyond_the_wire]})
            assert _error(refused, 400)["param"] == "tokens"
        both = http.post("/tokenize", json={"prompt": "a", "messages": QUESTION})
        assert _error(both, 400)["param"] == "prompt"
        # add_special_tokens: the default model's tokenizer adds none, so either value gives
        # the same ids here (a tokenizer that adds a BOS: test_prompt_rendering.py), and a
        # generation request's prompt is what /tokenize says for the same flag
        for flag in (True, False):
            plain = http.post(
                "/tokenize", json={"prompt": "Hello world", "add_special_tokens": flag}
            )
            assert plain.json()["tokens"] == text["tokens"]
            done = sdk.completions.create(
                model=model,
                prompt="Hello world",
                max_tokens=1,
                extra_body={"add_special_tokens": flag},
            )
            assert done.usage.prompt_tokens == len(text["tokens"])
            asked = http.post("/tokenize", json={"messages": QUESTION, "add_special_tokens": flag})
            assert asked.json()["tokens"] == chat["tokens"]
            answered = sdk.chat.completions.create(
                model=model,
                messages=QUESTION,
                max_tokens=1,
                extra_body={"add_special_tokens": flag},
            )
            assert answered.usage.prompt_tokens == chat["count"]
        version = http.get("/version")
        assert version.status_code == 200 and version.json()["version"]


def test_malformed_bodies_routes_and_sizes_get_openai_errors(
    served: Served, sdk: openai.OpenAI
) -> None:
    """What never reaches a route handler (bytes that are not JSON text, nesting deeper than
    the parser goes, a lone surrogate, an unknown route or method, a body over the gateway's
    16 MiB bound, declared or chunked) still gets OpenAI's error body and a 4xx, and the
    gateway serves normally afterwards."""
    model = _model(sdk)
    url = f"{served.url}/v1"
    json_headers = {"content-type": "application/json"}
    with httpx.Client(timeout=60) as http:
        not_utf8 = http.post(
            f"{url}/completions",
            content=b'{"model": "m", "prompt": "\xff\xfe"}',
            headers=json_headers,
        )
        _error(not_utf8, 400)
        deep = http.post(
            f"{url}/completions", content=b"[" * 5000 + b"]" * 5000, headers=json_headers
        )
        _error(deep, 400)
        for route, body in (
            ("completions", b'{"model": "%s", "prompt": "a \\ud800 b"}'),
            (
                "chat/completions",
                b'{"model": "%s", "messages": [{"role": "user", "content": "hi \\udfff"}]}',
            ),
            ("completions", b'{"model": "%s", "prompt": "hi", "stop": ["\\ud800"]}'),
        ):
            lone = http.post(f"{url}/{route}", content=body % model.encode(), headers=json_headers)
            assert "surrogate" in str(_error(lone, 400)["message"])
        assert _error(http.get(f"{url}/nowhere"), 404)["code"] == "not_found"
        wrong_method = http.get(f"{url}/completions")
        assert _error(wrong_method, 405)["code"] == "method_not_allowed"
        assert "POST" in wrong_method.headers["allow"]
        huge = b'{"model": "m", "prompt": "' + b"a" * (17 << 20) + b'"}'
        declared = http.post(f"{url}/completions", content=huge, headers=json_headers)
        assert _error(declared, 413)["code"] == "request_too_large"

        def chunks() -> Iterator[bytes]:
            for start in range(0, len(huge), 1 << 20):
                yield huge[start : start + (1 << 20)]

        chunked = http.post(f"{url}/completions", content=chunks(), headers=json_headers)
        assert _error(chunked, 413)["code"] == "request_too_large"
    again = sdk.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0)
    assert again.usage.completion_tokens == 3


def test_disconnect_mid_stream_aborts_and_frees_blocks(served: Served, sdk: openai.OpenAI) -> None:
    model = _model(sdk)
    body = {
        "model": model,
        "prompt": "Once upon a time " * 40,
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=60) as http,
        http.stream(
            "POST", f"{served.url}/v1/completions", json=body, headers={"x-request-id": "gone-1"}
        ) as response,
    ):
        assert response.headers["x-request-id"] == "gone-1"
        events = 0
        lines = response.iter_lines()  # held: a loop that drops it closes the stream at break
        for line in lines:
            if line.startswith("data: "):
                events += 1
            if events == 5:
                break
        decode = [load for load in worker_loads(served.coordinator).values()]
        assert any(load.num_used_blocks > 0 for load in decode)  # it really holds blocks
        # leaving the block closed the connection mid-stream
    assert_all_free(wait_until_idle(served.coordinator, 2), 2)


async def _overload(url: str, model: str, count: int) -> list[httpx.Response]:
    body = {"model": model, "prompt": "Tell me a story", "max_tokens": 48, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=300) as http:
        return await asyncio.gather(
            *(http.post(f"{url}/v1/completions", json=body) for _ in range(count))
        )


def test_overload_is_429_with_retry_after_and_metrics_move(
    served: Served, sdk: openai.OpenAI
) -> None:
    model = _model(sdk)
    gateway_before = _samples(f"{served.url}/metrics")
    decode_before = _samples(served.metrics_urls["decode"])
    responses = asyncio.run(_overload(served.url, model, 2 * MAX_INFLIGHT))
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 429}, statuses
    refused = [r for r in responses if r.status_code == 429]
    assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
    assert _error(refused[0], 429)["type"] == "rate_limit_error"
    served_ok = [r.json() for r in responses if r.status_code == 200]
    assert all(r["usage"]["completion_tokens"] == 48 for r in served_ok)
    assert_all_free(wait_until_idle(served.coordinator, 2), 2)

    gateway_after = _samples(f"{served.url}/metrics")
    ttft = "splitserve_time_to_first_token_seconds_count"
    assert _total(gateway_after, ttft) - _total(gateway_before, ttft) == len(served_ok)
    itl = "splitserve_inter_token_latency_seconds_count"
    assert _total(gateway_after, itl) - _total(gateway_before, itl) == 47 * len(served_ok)
    http_429 = "splitserve_http_requests_total{route=/v1/completions,status=429}"
    assert gateway_after[http_429] - gateway_before.get(http_429, 0) == len(refused)

    decode_after = _samples(served.metrics_urls["decode"])
    generated = _total(decode_after, "splitserve_generation_tokens_total") - _total(
        decode_before, "splitserve_generation_tokens_total"
    )
    assert generated == 47 * len(served_ok)  # the prefill worker sampled each first token
    received = _total(decode_after, "splitserve_kv_transfer_bytes_total") - _total(
        decode_before, "splitserve_kv_transfer_bytes_total"
    )
    assert received > 0
    runs = "splitserve_kv_transfer_block_runs_count"
    assert _total(decode_after, runs) - _total(decode_before, runs) == len(served_ok)
    assert _total(decode_after, "splitserve_kv_cache_usage_perc") == 0.0
    coordinator = _samples(served.metrics_urls["coordinator"])
    assert _total(coordinator, "splitserve_request_stage_seconds_count") > 0
    # the crowd that just arrived is demand for prefill workers (measured at the input)
    assert coordinator["splitserve_desired_workers{role=prefill}"] > 0
    assert coordinator["splitserve_desired_workers{role=decode}"] >= 0
    prefill = _samples(served.metrics_urls["prefill"])
    assert _total(prefill, "splitserve_prompt_tokens_total") > 0
    assert json.dumps(served_ok[0])  # bodies are plain JSON
