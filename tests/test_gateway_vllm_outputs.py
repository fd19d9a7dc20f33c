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


def _tokenize(served: Served, body: dict) -> list[int]:
    return httpx.post(f"{served.url}/tokenize", json=body, timeout=30).json()["tokens"]


def test_token_ids_are_returned_whole_and_streamed(served: Served, sdk: openai.OpenAI) -> None:
    """``return_token_ids``: the prompt's ids (those ``/tokenize`` gives) and each choice's
    generated ids; streamed, the first event carries the prompt's and the events' ids join
    to the whole response's."""
    model = _model(sdk)
    ids_of = {text: _tokenize(served, {"prompt": text}) for text in (PROMPT, "Hello")}
    asked = {"model": model, "prompt": [PROMPT, "Hello"], "max_tokens": 5, "temperature": 0,
             "return_token_ids": True}  # fmt: skip
    whole = httpx.post(f"{served.url}/v1/completions", json=asked, timeout=60).json()
    for choice, text in zip(whole["choices"], (PROMPT, "Hello"), strict=True):
        assert choice["prompt_token_ids"] == ids_of[text]
        assert len(choice["token_ids"]) == 5
        decoded = httpx.post(
            f"{served.url}/detokenize", json={"tokens": choice["token_ids"]}, timeout=30
        ).json()["prompt"]
        assert decoded == choice["text"]
    streamed = sdk.completions.create(
        **{k: v for k, v in asked.items() if k != "return_token_ids"}, stream=True,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    joined: dict[int, list[int]] = {0: [], 1: []}
    prompts_seen: dict[int, list[int]] = {}
    for event in streamed:
        for choice in event.model_dump()["choices"]:
            joined[choice["index"]] += choice.get("token_ids") or []
            if choice.get("prompt_token_ids") is not None:
                assert choice["index"] not in prompts_seen  # once per choice
                prompts_seen[choice["index"]] = choice["prompt_token_ids"]
    assert joined == {i: c["token_ids"] for i, c in enumerate(whole["choices"])}
    assert prompts_seen == {0: ids_of[PROMPT], 1: ids_of["Hello"]}

    chat_ids = _tokenize(served, {"messages": QUESTION})
    chat = {"model": model, "messages": QUESTION, "max_tokens": 4, "temperature": 0, "n": 2,
            "return_token_ids": True}  # fmt: skip
    answer = httpx.post(f"{served.url}/v1/chat/completions", json=chat, timeout=60).json()
    assert answer["prompt_token_ids"] == chat_ids
    assert [len(c["token_ids"]) for c in answer["choices"]] == [4, 4]
    events = list(sdk.chat.completions.create(
        **{k: v for k, v in chat.items() if k != "return_token_ids"}, stream=True,
        extra_body={"return_token_ids": True},
    ))  # fmt: skip
    dumped = [event.model_dump() for event in events]
    assert [e.get("prompt_token_ids") for e in dumped if e.get("prompt_token_ids")] == [
        chat_ids,
        chat_ids,  # the first event of each choice
    ]
    for index in (0, 1):
        streamed_ids = [t for e in dumped for c in e["choices"] if c["index"] == index
                        for t in c.get("token_ids") or []]  # fmt: skip
        assert streamed_ids == answer["choices"][index]["token_ids"]
    refused = httpx.post(
        f"{served.url}/v1/responses",
        json={"model": model, "input": "hi", "return_token_ids": True},
        timeout=30,
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "return_token_ids"


def test_chat_template_fields_render_the_prompt(served: Served, sdk: openai.OpenAI) -> None:
    """``continue_final_message`` continues a prefilled assistant answer (the chat completion
    equals the completion of the ids ``/tokenize`` renders for it); ``add_generation_prompt:
    false`` drops the generation prompt; ``echo`` leads the answer with the continued
    message's content; ``chat_template_kwargs`` reach the template, never
    over a name it is given; ``documents`` are refused where the template reads none."""
    model = _model(sdk)
    prefilled = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    ids = _tokenize(served, {"messages": prefilled, **fields})
    closed = _tokenize(served, {"messages": prefilled, "add_generation_prompt": False})
    with_prompt = _tokenize(served, {"messages": QUESTION})
    without = _tokenize(served, {"messages": QUESTION, "add_generation_prompt": False})
    assert closed[: len(ids)] == ids and len(closed) > len(ids)  # open: no end of turn
    assert with_prompt[: len(without)] == without and len(with_prompt) > len(without)
    answer = sdk.chat.completions.create(
        model=model, messages=prefilled, max_tokens=6, temperature=0,
        extra_body={**fields, "chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    plain = sdk.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0)
    assert answer.choices[0].message.content == plain.choices[0].text
    assert answer.usage.prompt_tokens == len(ids)
    # vLLM's chat echo: the continued message's content leads the answer, whole and streamed
    echoed = sdk.chat.completions.create(
        model=model, messages=prefilled, max_tokens=6, temperature=0,
        extra_body={**fields, "echo": True},
    )  # fmt: skip
    continued = "The capital of France is" + plain.choices[0].text
    assert echoed.choices[0].message.content == continued
    stream = sdk.chat.completions.create(
        model=model, messages=prefilled, max_tokens=6, temperature=0, stream=True,
        extra_body={**fields, "echo": True},
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == continued
    not_its_role = sdk.chat.completions.create(  # the last message is the user's: no echo
        model=model, messages=QUESTION, max_tokens=6, temperature=0, extra_body={"echo": True}
    )
    plain_chat = sdk.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=6, temperature=0
    )
    assert not_its_role.choices[0].message.content == plain_chat.choices[0].message.content
    for body, param in (
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"continue_final_message": True}, "continue_final_message"),  # generation prompt on
        ({"documents": [{"title": "t", "text": "x"}]}, "documents"),  # SmolLM2's reads none
        ({"chat_template": "{{ messages }}"}, "chat_template"),  # not trusted here
        ({"reasoning_effort": "low"}, "reasoning_effort"),  # SmolLM2's template reads none
        (
            {"documents": [{"text": "x"}], "chat_template_kwargs": {"documents": []}},
            "documents",
        ),
    ):
        refused = httpx.post(
            f"{served.url}/v1/chat/completions",
            json={"model": model, "messages": prefilled, **body},
            timeout=30,
        )
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    prompt_too = httpx.post(  # the template renders messages: with a prompt it says so
        f"{served.url}/tokenize",
        json={"prompt": "Hi", "chat_template_kwargs": {}, "continue_final_message": True},
        timeout=30,
    )
    assert prompt_too.status_code == 400
    assert prompt_too.json()["error"]["param"] == "continue_final_message"


def test_a_truncated_prompt_is_its_last_tokens(served: Served, sdk: openai.OpenAI) -> None:
    """``truncate_prompt_tokens``: the coordinator keeps the prompt's last N tokens; what the
    response shows of the prompt (its ids, the echoed text) is those; a prompt over the
    context is served once truncated (refused without)."""
    model = _model(sdk)
    ids = _tokenize(served, {"prompt": PROMPT})
    kept = ids[-8:]
    answer = httpx.post(
        f"{served.url}/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
              "truncate_prompt_tokens": 8, "return_token_ids": True, "echo": True},
        timeout=60,
    ).json()  # fmt: skip
    choice = answer["choices"][0]
    assert choice["prompt_token_ids"] == kept and answer["usage"]["prompt_tokens"] == 8
    plain = sdk.completions.create(model=model, prompt=kept, max_tokens=4, temperature=0)
    text = httpx.post(f"{served.url}/detokenize", json={"tokens": kept}, timeout=30).json()
    assert choice["text"] == text["prompt"] + plain.choices[0].text
    huge = "word " * 9000  # over the 8,192-token context
    refused = httpx.post(
        f"{served.url}/v1/completions",
        json={"model": model, "prompt": huge, "max_tokens": 2},
        timeout=60,
    )
    assert refused.status_code == 400
    served_huge = sdk.completions.create(
        model=model, prompt=huge, max_tokens=2, extra_body={"truncate_prompt_tokens": 16}
    )
    assert served_huge.usage.prompt_tokens == 16
    zero = httpx.post(
        f"{served.url}/v1/chat/completions",
        json={"model": model, "messages": QUESTION, "truncate_prompt_tokens": 0},
        timeout=30,
    )
    assert zero.status_code == 400 and zero.json()["error"]["param"] == "truncate_prompt_tokens"
    for path, body in (
        ("/v1/chat/completions", {"messages": QUESTION}),
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/responses", {"input": "hi"}),
    ):
        beyond = httpx.post(  # past int32 (the wire's field): refused here, not a 500
            f"{served.url}{path}",
            json={"model": model, **body, "truncate_prompt_tokens": 2**32},
            timeout=30,
        )
        assert beyond.status_code == 400, (path, beyond.text)
        assert beyond.json()["error"]["param"] == "truncate_prompt_tokens"


def test_bad_words_and_allowed_token_ids_hold_on_every_token(
    served: Served, sdk: openai.OpenAI
) -> None:
    """``bad_words`` keep a word out of what greedy decoding would write, whole and streamed;
    ``allowed_token_ids`` keep a sampled answer to its tokens; bad values are 400s naming the
    field."""
    model = _model(sdk)
    plain = sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=12,
                                        temperature=0)  # fmt: skip
    assert "Paris" in plain.choices[0].message.content
    banned = sdk.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=12, temperature=0,
        extra_body={"bad_words": ["Paris"]},
    )  # fmt: skip
    assert "Paris" not in banned.choices[0].message.content
    streamed = sdk.completions.create(
        model=model, prompt="The capital of France is", max_tokens=8, temperature=0,
        stream=True, extra_body={"bad_words": [" Paris"]},
    )  # fmt: skip
    assert "Paris" not in "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
    allowed = _tokenize(served, {"prompt": " yes no maybe"})
    answer = httpx.post(
        f"{served.url}/v1/completions",
        json={"model": model, "prompt": "Is the sky blue? Answer:", "max_tokens": 6,
              "temperature": 1.0, "seed": 5, "n": 3, "ignore_eos": True,
              "allowed_token_ids": allowed, "return_token_ids": True},
        timeout=60,
    ).json()  # fmt: skip
    for choice in answer["choices"]:
        assert len(choice["token_ids"]) == 6 and set(choice["token_ids"]) <= set(allowed)
    for body in (
        {"allowed_token_ids": []},
        {"allowed_token_ids": [10**7]},
        {"allowed_token_ids": allowed, "response_format": {"type": "json_object"}},
        {"bad_words": [""]},
    ):
        refused = httpx.post(
            f"{served.url}/v1/chat/completions",
            json={"model": model, "messages": QUESTION, "max_tokens": 2, **body},
            timeout=30,
        )
        field = next(iter(body))
        assert refused.status_code == 400, body
        assert refused.json()["error"]["param"] == field, refused.json()


def test_a_cache_salt_keeps_cached_prefixes_apart(served: Served, sdk: openai.OpenAI) -> None:
    """``cache_salt``: a prompt's cached KV serves a later request only under the same salt
    (the workers' prefix caches and the router key blocks by salted hashes)."""
    model = _model(sdk)
    prompt = "A tenant's private notes, line after line. " * 40  # some 400 tokens

    def cached(salt: str | None) -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        answer = sdk.completions.create(
            model=model, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra
        )
        return answer.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0
    assert cached(None) == 0
    assert cached("tenant-a") > 0
    too_long = httpx.post(
        f"{served.url}/v1/completions",
        json={"model": model, "prompt": "x", "cache_salt": "s" * 1025},
        timeout=30,
    )
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "cache_salt"


def test_the_body_s_request_id_names_the_request(served: Served, sdk: openai.OpenAI) -> None:
    """vLLM's body ``request_id`` names the request as the ``x-request-id`` header does; the
    header wins when both are sent; an id a header cannot hold is echoed percent-encoded."""
    body = {"model": _model(sdk), "prompt": PROMPT, "max_tokens": 2, "request_id": "body-id-1"}
    named = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
    assert named.status_code == 200 and named.headers["x-request-id"] == "body-id-1"
    both = httpx.post(
        f"{served.url}/v1/completions",
        json={**body, "request_id": "body-id-2"},
        headers={"x-request-id": "header-id-2"},
        timeout=60,
    )
    assert both.status_code == 200 and both.headers["x-request-id"] == "header-id-2"
    for asked, echoed in (("Ā-ü 1", "%C4%80-%C3%BC%201"), ("line\nbreak", "line%0Abreak")):
        other = httpx.post(  # any character: echoed percent-encoded (a 500 before)
            f"{served.url}/v1/completions", json={**body, "request_id": asked}, timeout=60
        )
        assert other.status_code == 200 and other.headers["x-request-id"] == echoed


def test_tokenize_counts_the_tools_a_chat_shows(served: Served, sdk: openai.OpenAI) -> None:
    """``/tokenize`` with ``tools`` counts what a chat completion of them is prompted with
    (its usage's prompt tokens); tools without messages are a 400 naming them."""
    tool = {
        "type": "function",
        "function": {"name": "add", "parameters": {"type": "object", "properties": {}}},
    }
    with_tools = _tokenize(served, {"messages": QUESTION, "tools": [tool]})
    assert len(with_tools) > len(_tokenize(served, {"messages": QUESTION}))
    answer = sdk.chat.completions.create(
        model=_model(sdk), messages=QUESTION, tools=[tool], max_tokens=1, temperature=0
    )
    assert answer.usage.prompt_tokens == len(with_tools)
    refused = httpx.post(
        f"{served.url}/tokenize", json={"prompt": "Hi", "tools": [tool]}, timeout=30
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"
