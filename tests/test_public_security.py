"""Outside-in: a whole cluster with TLS and API keys (``splitserve up`` with ``--tls-cert``,
``--tls-key``, ``--tls-ca`` and ``--api-keys-file``; coordinator, a prefill and a decode
worker, gateway, KV over UCX), certificates made here (``tests/certs.py``).

- The README's ``openai`` SDK example works over HTTPS with a key, and streams what the gRPC
  client streams over TLS; without a key, or with a wrong one, it gets 401 with OpenAI's
  error body, while ``/health`` and ``/metrics`` stay open.
- The coordinator's public port refuses calls without a key (UNAUTHENTICATED) but answers
  health checks, and refuses plaintext.
- The internal plane is mutual TLS: a caller holding the cluster credential but no client
  certificate, or one signed by another CA, is refused at the handshake; with both it is
  admitted.
- An Abort by request id from another key does not end the stream; from the key that started
  it, it does; no KV block is left held.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.client import AsyncClient, ClientError, Finish, Generation, Sampling
from splitserve.proto.splitserve.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.certs import CertificateSet, make_certificates
from tests.cluster import (
    CREDENTIAL,
    assert_all_free,
    cluster,
    internal_address,
    internal_channel,
    wait_until_idle,
)

pytestmark = pytest.mark.timeout(300)

WORKER_FLAGS = ("--dtype=float32", "--num-blocks=256", "--threads=1")
ALICE_KEY = "sk-alice-0123456789abcdef"
BOB_KEY = "sk-bob-fedcba9876543210"
HAIKU = [{"role": "user", "content": "Write a haiku about the sea."}]


@dataclass(frozen=True)
class SecureCluster:
    coordinator: str
    gateway_url: str
    certs: CertificateSet

    def grpc_tls(self, certs: CertificateSet | None = None) -> grpc.ChannelCredentials:
        """Channel credentials trusting the cluster's CA, presenting ``certs``'s leaf (none:
        no client certificate)."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.certs.ca.read_bytes(),
            private_key=None if certs is None else certs.key.read_bytes(),
            certificate_chain=None if certs is None else certs.cert.read_bytes(),
        )

    def verify(self) -> ssl.SSLContext:
        """What an HTTP client verifies the gateway against: the cluster's CA."""
        return ssl.create_default_context(cafile=self.certs.ca)

    def client(self, api_key: str | None) -> AsyncClient:
        return AsyncClient(self.coordinator, api_key=api_key, credentials=self.grpc_tls())


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureCluster]:
    directory = tmp_path_factory.mktemp("tls")
    certs = make_certificates(directory / "cluster")
    keys_file = directory / "api-keys"
    keys_file.write_text(f"# key tenant\n{ALICE_KEY} alice\n{BOB_KEY} bob\n")
    tenants_file = directory / "tenants.toml"
    tenants_file.write_text("[tenants.alice]\nprivate_prefix_cache = true\n")
    lines: dict[str, str] = {}
    flags = (*certs.flags(), f"--api-keys-file={keys_file}")
    env = {  # up's coordinator reads them
        "SPLITSERVE_TENANTS_FILE": str(tenants_file),
        "SPLITSERVE_LORA_ADMIN_TENANTS": "alice",
    }
    with cluster(1, 1, *WORKER_FLAGS, ready_lines=lines, up_flags=flags, env=env) as coordinator:
        yield SecureCluster(coordinator, lines["splitserve gateway ready"], certs)


def _sdk(served: SecureCluster, api_key: str) -> openai.OpenAI:
    http = httpx.Client(verify=served.verify())
    return openai.OpenAI(
        base_url=f"{served.gateway_url}/v1", api_key=api_key, http_client=http, max_retries=0
    )


def _readme_example(client: openai.OpenAI) -> tuple[str, int]:
    """The README's streaming example: (text, completion tokens)."""
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model,
        messages=HAIKU,
        max_tokens=48,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, completion_tokens = "", -1
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        elif chunk.usage:
            completion_tokens = chunk.usage.completion_tokens
    return text, completion_tokens


@pytest.mark.slow  # TLS, keys and aborts on this secure cluster: the tests around it
def test_the_readme_sdk_example_works_over_https_with_a_key(served: SecureCluster) -> None:
    assert served.gateway_url.startswith("https://")
    text, completion_tokens = _readme_example(_sdk(served, ALICE_KEY))

    async def over_grpc() -> tuple[str, int]:
        async with served.client(ALICE_KEY) as client:
            sampling = Sampling(max_tokens=48, temperature=0.0)
            generation = await client.generate(messages=HAIKU, sampling=sampling)
            return generation.text, generation.usage.completion_tokens

    assert completion_tokens > 0 and text
    assert (text, completion_tokens) == asyncio.run(over_grpc())


def test_the_sdk_with_a_wrong_key_gets_401_in_openais_shape(served: SecureCluster) -> None:
    with pytest.raises(openai.AuthenticationError) as raised:
        _sdk(served, "sk-not-a-key-of-this-cluster").chat.completions.create(
            model="any", messages=HAIKU, max_tokens=4
        )
    assert raised.value.status_code == 401
    body = raised.value.body
    assert isinstance(body, dict)
    assert body["code"] == "invalid_api_key" and body["type"] == "invalid_request_error"
    assert body["message"] and body["param"] is None
    assert raised.value.response.headers["www-authenticate"] == "Bearer"
    # its body unread, the connection closes: nothing of it is taken for a next request, and
    # a drain is not held for it (it held the gateway's for its 30 s drain timeout)
    assert raised.value.response.headers["connection"] == "close"


def test_no_key_gets_401_in_openais_shape(served: SecureCluster) -> None:
    """(The SDK refuses to send no key; a raw HTTP client can.)"""
    response = httpx.post(
        f"{served.gateway_url}/v1/chat/completions",
        json={"model": "any", "messages": HAIKU, "max_tokens": 4},
        verify=served.verify(),
    )
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}


def test_health_and_metrics_stay_open(served: SecureCluster) -> None:
    verify = served.verify()
    assert httpx.get(f"{served.gateway_url}/health", verify=verify).status_code == 200
    metrics = httpx.get(f"{served.gateway_url}/metrics", verify=verify)
    assert metrics.status_code == 200 and "splitserve_http_requests" in metrics.text
    unauthorized = httpx.get(f"{served.gateway_url}/v1/models", verify=verify)
    assert unauthorized.status_code == 401
    assert unauthorized.json()["error"]["code"] == "invalid_api_key"


async def _code_of(call: object) -> grpc.StatusCode:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def test_the_public_port_wants_a_key_and_tls(served: SecureCluster) -> None:
    async def body() -> dict[str, grpc.StatusCode]:
        codes = {}
        async with grpc.aio.secure_channel(served.coordinator, served.grpc_tls()) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            request = coordinator_pb2.GetModelInfoRequest()
            codes["no key"] = await _code_of(stub.GetModelInfo(request, timeout=10))
            wrong = (("authorization", "Bearer sk-wrong"),)
            codes["wrong key"] = await _code_of(
                stub.GetModelInfo(request, timeout=10, metadata=wrong)
            )
            alice = (("authorization", f"Bearer {ALICE_KEY}"),)
            codes["alice"] = await _code_of(stub.GetModelInfo(request, timeout=10, metadata=alice))
            health = health_pb2_grpc.HealthStub(channel)
            codes["health"] = await _code_of(health.Check(health_pb2.HealthCheckRequest()))
        async with grpc.aio.insecure_channel(served.coordinator) as plaintext:
            stub = coordinator_pb2_grpc.CoordinatorStub(plaintext)
            codes["plaintext"] = await _code_of(
                stub.GetModelInfo(coordinator_pb2.GetModelInfoRequest(), timeout=5)
            )
        return codes

    codes = asyncio.run(body())
    assert codes == {
        "no key": grpc.StatusCode.UNAUTHENTICATED,
        "wrong key": grpc.StatusCode.UNAUTHENTICATED,
        "alice": grpc.StatusCode.OK,
        "health": grpc.StatusCode.OK,
        "plaintext": grpc.StatusCode.UNAVAILABLE,
    }


def test_the_internal_plane_is_mutual_tls(served: SecureCluster, tmp_path: Path) -> None:
    internal = internal_address(served.coordinator)
    stranger = make_certificates(tmp_path / "stranger", "stranger")
    request = coordinator_pb2.ListWorkersRequest()

    def list_workers(tls: grpc.ChannelCredentials) -> grpc.StatusCode:
        with internal_channel(internal, tls) as channel:
            stub = coordinator_pb2_grpc.MembershipStub(channel)
            try:
                stub.ListWorkers(request, timeout=5, metadata=CREDENTIAL.metadata)
            except grpc.RpcError as error:
                return error.code()  # type: ignore[attr-defined]
            return grpc.StatusCode.OK

    # Both refused during the handshake, before the credential is even looked at.
    assert list_workers(served.grpc_tls()) == grpc.StatusCode.UNAVAILABLE
    assert list_workers(served.grpc_tls(stranger)) == grpc.StatusCode.UNAVAILABLE
    assert list_workers(served.grpc_tls(served.certs)) == grpc.StatusCode.OK


async def _first_chunk_then_rest(
    items: contextlib.AbstractAsyncContextManager, started: asyncio.Event
) -> Finish:
    async with items as stream:
        async for item in stream:
            started.set()
            if isinstance(item, Finish):
                return item
    raise AssertionError("no finish")


def test_only_the_key_that_started_a_request_can_abort_it(served: SecureCluster) -> None:
    long = Sampling(max_tokens=48, temperature=0.0, ignore_eos=True)

    async def body() -> tuple[bool, Finish, bool, Finish]:
        async with served.client(ALICE_KEY) as alice, served.client(BOB_KEY) as bob:
            kept_started, ended_started = asyncio.Event(), asyncio.Event()
            kept = asyncio.create_task(
                _first_chunk_then_rest(
                    contextlib.aclosing(
                        alice.stream("Count to fifty:", sampling=long, request_id="alice-kept")
                    ),
                    kept_started,
                )
            )
            ended = asyncio.create_task(
                _first_chunk_then_rest(
                    contextlib.aclosing(
                        alice.stream("Name the planets:", sampling=long, request_id="alice-ended")
                    ),
                    ended_started,
                )
            )
            await asyncio.wait_for(kept_started.wait(), 60)
            await asyncio.wait_for(ended_started.wait(), 60)
            bob_aborted = await bob.abort("alice-kept")
            alice_aborted = await alice.abort("alice-ended")
            return bob_aborted, await kept, alice_aborted, await ended

    bob_aborted, kept, alice_aborted, ended = asyncio.run(body())
    assert bob_aborted is False
    assert kept.finish_reason == "length" and kept.usage.completion_tokens == 48
    assert alice_aborted is True
    assert ended.finish_reason == "abort" and ended.usage.completion_tokens < 48
    loads = wait_until_idle(served.coordinator, 2, tls=served.grpc_tls(served.certs))
    assert_all_free(loads, 2)


def test_a_wrong_key_gets_unauthenticated_from_the_client(served: SecureCluster) -> None:
    async def body() -> ClientError:
        async with served.client("sk-wrong") as client:
            with pytest.raises(ClientError) as raised:
                await client.generate("Hello", sampling=Sampling(max_tokens=2))
            return raised.value

    assert asyncio.run(body()).code == grpc.StatusCode.UNAUTHENTICATED


def test_request_ids_are_scoped_per_tenant(served: SecureCluster) -> None:
    """Two tenants may use the same request id at once (neither learns the other's is
    live); within a tenant a live id is refused; a priority above the tenant's highest is
    refused. Alice's long request, live all along, is then aborted by her (its id is hers)."""
    long = Sampling(max_tokens=2000, temperature=0.0, ignore_eos=True)
    short = Sampling(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def body() -> tuple[Finish, Generation, ClientError, ClientError]:
        async with served.client(ALICE_KEY) as alice, served.client(BOB_KEY) as bob:
            started = asyncio.Event()
            alices = asyncio.create_task(
                _first_chunk_then_rest(
                    contextlib.aclosing(alice.stream("Count:", sampling=long, request_id="same")),
                    started,
                )
            )
            await asyncio.wait_for(started.wait(), 60)
            with pytest.raises(ClientError) as duplicate:
                await alice.generate("Count:", sampling=short, request_id="same")
            bobs = await bob.generate("Count:", sampling=short, request_id="same")
            assert not alices.done()  # bob's ran while alice's "same" was live
            with pytest.raises(ClientError) as too_high:
                await bob.generate("Count:", sampling=short, priority=1)
            assert not alices.done()  # still live: ended only by its own tenant's abort
            assert await alice.abort("same")
            return await alices, bobs, duplicate.value, too_high.value

    alices, bobs, duplicate, too_high = asyncio.run(body())
    assert (alices.finish_reason, bobs.finish_reason) == ("abort", "length")
    assert 0 < alices.usage.completion_tokens < 2000 and bobs.usage.completion_tokens == 8
    assert bobs.request_id == "same"
    assert duplicate.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "already running" in duplicate.message
    assert too_high.code == grpc.StatusCode.INVALID_ARGUMENT and too_high.param == "priority"
    assert_all_free(wait_until_idle(served.coordinator, 2, tls=served.grpc_tls(served.certs)), 2)


def test_a_private_prefix_cache_serves_its_tenant_alone(served: SecureCluster) -> None:
    """Alice's tenant has ``private_prefix_cache``: her prompt's cached KV serves her next
    request, never Bob's (whose tenant shares the common namespace), whatever salt Bob sends;
    a salt that could name a tenant's namespace is refused."""
    prompt = "Alice's quarterly figures, not for anyone else. " * 30  # some 300 tokens
    with _sdk(served, ALICE_KEY) as alice, _sdk(served, BOB_KEY) as bob:  # closed: no idle
        model = alice.models.list().data[0].id  # connection keeps the gateway from stopping

        def cached(sdk: openai.OpenAI, salt: str | None = None) -> int:
            extra = {} if salt is None else {"cache_salt": salt}
            answer = sdk.completions.create(
                model=model, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra
            )
            return answer.usage.prompt_tokens_details.cached_tokens

        assert cached(alice) == 0
        assert cached(bob) == 0  # her blocks are under her tenant's salt
        assert cached(alice) > 0
        assert cached(bob) > 0  # his own first request's, in the common namespace
        with pytest.raises(openai.BadRequestError) as refused:
            cached(bob, "\x00alice\x00")
        assert refused.value.body["param"] == "cache_salt"


def test_only_lora_admin_tenants_may_load_adapters(served: SecureCluster) -> None:
    """With keys, ``/v1/load_lora_adapter`` is refused 403 to a tenant not among the
    coordinator's ``--lora-admin-tenants`` before any worker is asked; an admin's call
    reaches the workers, which refuse it 400 here (started without ``--lora-dir``)."""
    with httpx.Client(base_url=served.gateway_url, verify=served.verify()) as http:

        def load(key: str) -> httpx.Response:
            body = {"lora_name": "tuned", "lora_path": "every"}
            headers = {"Authorization": f"Bearer {key}"}
            return http.post("/v1/load_lora_adapter", json=body, headers=headers)

        bob, alice = load(BOB_KEY), load(ALICE_KEY)
        unload = http.post(
            "/v1/unload_lora_adapter",
            json={"lora_name": "tuned"},
            headers={"Authorization": f"Bearer {BOB_KEY}"},
        )
    assert bob.status_code == 403, bob.text
    assert bob.json()["error"]["code"] == "permission_denied"
    assert unload.status_code == 403, unload.text
    assert alice.status_code == 400, alice.text
    assert "--lora-dir" in alice.json()["error"]["message"]
