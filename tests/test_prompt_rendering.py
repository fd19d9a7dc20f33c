"""How a prompt becomes token ids: vLLM's ``add_special_tokens`` (``common/prompt.py``) and
a chat's tool call ids and calls in the chat template (``common/chat_messages.py``), checked
on a tokenizer that adds a BOS (the default model's vocabulary; its own adds none) with
templates that render the tool fields and one that does not; then through the real gateway's
``/tokenize`` (httpx: the openai SDK has no method for it) and gRPC client over a real
in-process coordinator of that tokenizer (no workers: tokenizing needs none)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest
import tokenizers

from splitserve.client import AsyncClient, ChatMessage, ChatTemplate, ToolCall
from splitserve.common.chat_messages import template_messages
from splitserve.common.errors import InvalidRequestError
from splitserve.common.model_files import load_tokenizer
from splitserve.common.prompt import TRUNCATE_TO_CONTEXT, Chat, encode_prompt, truncated
from splitserve.common.tokenizer import Tokenizer
from splitserve.coordinator.service import Coordinator, CoordinatorConfig
from splitserve.coordinator.servicer import CoordinatorServicer
from splitserve.gateway.app import GatewayConfig, create_app
from splitserve.proto.cluster_access import ClusterAccess
from splitserve.proto.splitserve.v1 import coordinator_pb2_grpc
from tests.cluster import CREDENTIAL

PRINTS_TOOLS = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.tool_call_id %}[answers {{ m.tool_call_id }}]{% endif %}"
    "{% for c in m.tool_calls or [] %}[call {{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}]{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A template that renders a message's tool call id and calls itself."""
PLAIN = (
    "{% for m in messages %}{{ bos_token }}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""One that renders only roles and contents (as the default model's), with the BOS itself."""
CALL = ToolCall("get_weather", '{"city": "Paris"}', "call_7")
HISTORY = [
    ChatMessage("user", "Weather in Paris?"),
    ChatMessage("assistant", "", tool_calls=(CALL,)),
    ChatMessage("tool", "Sunny", tool_call_id="call_7"),
]


def _tokenizer(template: str) -> Tokenizer:
    """The default model's vocabulary, adding ``<|endoftext|>`` as BOS, with ``template``."""
    backend = tokenizers.Tokenizer.from_str(load_tokenizer(None).backend.to_str())
    return Tokenizer(
        backend, chat_template=template, bos_token="<|endoftext|>", eos_token="<|im_end|>",
        add_bos_token=True,
    )  # fmt: skip


@pytest.fixture(scope="module", name="printing")
def printing_fixture() -> Tokenizer:
    return _tokenizer(PRINTS_TOOLS)


def test_add_special_tokens_adds_the_bos_to_text_by_default_and_to_chats_when_asked(
    printing: Tokenizer,
) -> None:
    bos = printing.bos_token_id
    assert bos is not None
    text = encode_prompt(printing, "Hello world")
    assert text == encode_prompt(printing, "Hello world", True)
    assert text == [bos, *encode_prompt(printing, "Hello world", False)]
    chat = [ChatMessage("user", "Hi")]
    plain = encode_prompt(printing, chat)
    assert plain == encode_prompt(printing, chat, False) and plain[0] != bos
    assert encode_prompt(printing, chat, True) == [bos, *plain]
    assert encode_prompt(printing, [5, 6], True) == [5, 6]  # token ids are used as given
    default = load_tokenizer(None)  # adds nothing: the flag changes nothing
    assert encode_prompt(default, "Hello", True) == encode_prompt(default, "Hello", False)


def test_a_template_that_renders_tool_fields_sees_them_and_the_contents_as_sent(
    printing: Tokenizer,
) -> None:
    shown = template_messages(HISTORY, PRINTS_TOOLS)
    assert shown[1] == {
        "role": "assistant", "content": "",
        "tool_calls": [{"id": "call_7", "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    }  # fmt: skip
    assert shown[2] == {"role": "tool", "content": "Sunny", "tool_call_id": "call_7"}
    rendered = printing.decode(encode_prompt(printing, HISTORY), skip_special_tokens=False)
    assert '<|im_start|>assistant\n[call call_7 get_weather {"city": "Paris"}]<|im_end|>' in (
        rendered
    )
    assert "<|im_start|>tool\nSunny[answers call_7]<|im_end|>" in rendered


def test_a_template_without_tool_fields_gets_them_in_the_contents() -> None:
    """The default model's template names neither field: the calls (ids included) and the
    id a result answers are written into the contents, in the tool-call format."""
    default = load_tokenizer(None)
    assert "tool_call" not in (default.chat_template or "")
    shown = template_messages(HISTORY, default.chat_template)
    assert json.loads(str(shown[1]["content"])) == {
        "tool_calls": [{"id": "call_7", "name": "get_weather", "arguments": {"city": "Paris"}}]
    }
    assert json.loads(str(shown[2]["content"])) == {"tool_call_id": "call_7", "content": "Sunny"}
    assert shown[2]["tool_call_id"] == "call_7" and shown[1]["tool_calls"]
    rendered = default.decode(encode_prompt(default, HISTORY), skip_special_tokens=False)
    assert rendered.count("call_7") == 2
    plain_tokenizer = _tokenizer(PLAIN)
    assert encode_prompt(plain_tokenizer, HISTORY)[0] == plain_tokenizer.bos_token_id  # once
    assert encode_prompt(plain_tokenizer, HISTORY)[1] != plain_tokenizer.bos_token_id
    with pytest.raises(InvalidRequestError) as refused:
        template_messages([ChatMessage("assistant", "", tool_calls=(ToolCall("f", "{x"),))], "")
    assert refused.value.param == "messages"


@contextlib.asynccontextmanager
async def _gateway(
    tokenizer: Tokenizer, config: CoordinatorConfig | None = None
) -> AsyncIterator[tuple[httpx.AsyncClient, str]]:
    """The real gateway app (in process, over ASGI) in front of a real coordinator of
    ``tokenizer`` (``config``, default: a model "m" with the defaults) served on a free port;
    yields an HTTP client of the gateway and the coordinator's address."""
    coordinator = Coordinator(
        config or CoordinatorConfig(model_name="m"), tokenizer, ClusterAccess(CREDENTIAL)
    )
    server = grpc.aio.server()
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(coordinator), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    app = create_app(GatewayConfig(coordinators=(address,)))
    try:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://gateway", timeout=30
            ) as http,
        ):
            yield http, address
    finally:
        await server.stop(None)


def test_the_gateway_tokenizes_with_add_special_tokens_and_tool_fields(
    printing: Tokenizer,
) -> None:
    """``/tokenize`` answers what ``encode_prompt`` makes of each body (the flag, its default
    per kind, the tool fields), and the gRPC client sends the same."""
    bos = printing.bos_token_id
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_7", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "Sunny"},
    ]  # fmt: skip

    async def scenario() -> None:
        async with _gateway(printing) as (http, address):

            async def ids(**body: object) -> list[int]:
                answer = await http.post("/tokenize", json=body)
                assert answer.status_code == 200, answer.text
                return answer.json()["tokens"]

            text = await ids(prompt="Hello world")
            assert text == await ids(prompt="Hello world", add_special_tokens=True)
            assert text == [bos, *await ids(prompt="Hello world", add_special_tokens=False)]
            assert text == encode_prompt(printing, "Hello world")
            chat = await ids(messages=history)
            assert chat == encode_prompt(printing, HISTORY) and chat[0] != bos
            assert await ids(messages=history, add_special_tokens=True) == [bos, *chat]
            async with AsyncClient(address) as client:
                assert await client.tokenize(messages=HISTORY, add_special_tokens=True) == [
                    bos, *chat
                ]  # fmt: skip
            refused = await http.post(
                "/tokenize", json={"prompt": "a", "add_special_tokens": "sometimes"}
            )
            assert refused.status_code == 400
            assert "add_special_tokens" in refused.json()["error"]["param"]
            lone = [{"role": "tool", "content": "x", "tool_call_id": "\ud800"}]  # JSON-escaped
            refused = await http.post(
                "/tokenize",
                content=json.dumps({"messages": lone}),
                headers={"content-type": "application/json"},
            )
            assert refused.status_code == 400, refused.text  # was a 500: protobuf's UTF-8
            assert "messages.0.tool_call_id" in refused.json()["error"]["message"]

    asyncio.run(scenario())


OWN_TEMPLATE = (
    "{% for d in documents or [] %}<doc>{{ d.text }}</doc>{% endfor %}"
    "{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
)
"""A template of a request's own: its own markers, reading documents."""


def test_a_requests_own_chat_template_only_where_the_coordinator_trusts_them(
    printing: Tokenizer,
) -> None:
    """vLLM's ``chat_template``: refused naming it by a coordinator without
    ``--trust-request-chat-template`` (the default); with it, the request's template renders
    the messages (and the documents it reads) instead of the model's, through the gateway and
    the gRPC client alike; one that does not compile is a 400 naming it."""
    messages = [{"role": "user", "content": "Hi"}]
    own = encode_prompt(printing, Chat([ChatMessage("user", "Hi")], template=OWN_TEMPLATE))
    assert printing.decode(own) == "[USER] Hi\n[ASSISTANT] "
    assert own != encode_prompt(printing, [ChatMessage("user", "Hi")])

    async def scenario() -> None:
        async with _gateway(printing) as (http, _):
            refused = await http.post(
                "/tokenize", json={"messages": messages, "chat_template": OWN_TEMPLATE}
            )
            assert refused.status_code == 400 and refused.json()["error"]["param"] == (
                "chat_template"
            ), refused.text
            assert "--trust-request-chat-template" in refused.json()["error"]["message"]
        trusting = CoordinatorConfig(model_name="m", trust_request_chat_template=True)
        async with _gateway(printing, trusting) as (http, address):
            answer = await http.post(
                "/tokenize", json={"messages": messages, "chat_template": OWN_TEMPLATE}
            )
            assert answer.status_code == 200 and answer.json()["tokens"] == own, answer.text
            grounded = await http.post("/tokenize", json={
                "messages": messages, "chat_template": OWN_TEMPLATE,
                "documents": [{"text": "Paris is in France"}],
            })  # fmt: skip
            assert printing.decode(grounded.json()["tokens"]).startswith(
                "<doc>Paris is in France</doc>[USER] Hi"
            ), grounded.text
            broken = await http.post(
                "/tokenize", json={"messages": messages, "chat_template": "{% for %}"}
            )
            assert broken.status_code == 400, broken.text
            assert broken.json()["error"]["param"] == "chat_template"
            async with AsyncClient(address) as client:
                ids = await client.tokenize(
                    messages=[ChatMessage("user", "Hi")],
                    chat_template=ChatTemplate(source=OWN_TEMPLATE),
                )
                assert ids == own

    asyncio.run(scenario())


def test_truncation_keeps_the_prompts_last_tokens() -> None:
    """vLLM's ``truncate_prompt_tokens``: the last N tokens; -1 as many as the context takes
    with one left to generate; another value below 1 is refused naming the field."""
    ids = list(range(10))
    assert truncated(ids, None, 8) == ids
    assert truncated(ids, 3, 8) == [7, 8, 9]
    assert truncated(ids, 20, 8) == ids  # longer than the prompt: all of it
    assert truncated(ids, TRUNCATE_TO_CONTEXT, 8) == ids[-7:]
    for bad in (0, -2):
        with pytest.raises(InvalidRequestError) as refused:
            truncated(ids, bad, 8)
        assert refused.value.param == "truncate_prompt_tokens"
