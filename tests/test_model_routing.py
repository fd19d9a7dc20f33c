"""Several models in one cluster (issue 32): a coordinator per model, the gateway routing by
the request's ``model`` (``gateway/model_routes.py``), workers announcing their checkpoint.

End to end: ``splitserve up --extra-model DIR`` serves the default model (a prefill and a
decode worker) beside a differently shaped one of random weights (its own coordinator and
dual-role worker), float32. Through the gateway with the openai SDK: ``/v1/models`` lists
both; each model's greedy completion equals its in-process engine on the same weights, in
one request burst that mixes them; an unknown model is a 404 naming ``model``. Over gRPC, a
coordinator asked for another model answers NOT_FOUND, and the second model's coordinator
lists only its own worker. A worker of another model is refused at registration (a real gRPC
Membership server) and passed over on etcd (a real etcd), and the pieces each decision rests
on are tested alone.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import grpc
import openai
import pytest

from splitserve.client import AsyncClient, ClientError, Sampling
from splitserve.common.adapter_id import AdapterId
from splitserve.common.kv_layout import KvLayout
from splitserve.common.membership import Role, WorkerInfo
from splitserve.common.sampling_params import SamplingParams
from splitserve.coordinator.membership_follower import MembershipFollower
from splitserve.coordinator.membership_servicer import MembershipServicer
from splitserve.coordinator.registry import WorkerRegistry, record_of
from splitserve.coordinator.service import CoordinatorConfig
from splitserve.discovery.etcd_announcer import EtcdAnnouncer
from splitserve.discovery.etcd_watcher import EtcdMembershipWatcher
from splitserve.engine.config import EngineConfig, ModelConfig
from splitserve.engine.llm import LLM
from splitserve.engine.random_checkpoint import save_random_model
from splitserve.gateway.main import coordinator_targets
from splitserve.proto import convert
from splitserve.proto.cluster_access import ClusterAccess
from splitserve.proto.cluster_auth import ClusterCredential
from splitserve.proto.etcd_client import EtcdClient
from splitserve.proto.server import start_server
from splitserve.proto.splitserve.v1 import coordinator_pb2, coordinator_pb2_grpc
from splitserve.proto.worker_clients import WorkerChannels
from tests.cluster import cluster, remember_internal, worker_loads
from tests.etcd import EtcdServer

PROMPTS = ("The capital of France is", "Once upon a time")
TINY_PROMPTS = ("t5 t6 t7 t8", "t100 t200 t300")
MAX_TOKENS = 8
LAYOUT = KvLayout(
    model="m", dtype="float32", block_size=16, num_layers=2, num_kv_heads=2, head_dim=8
)


def _reference(model: str, prompts: tuple[str, ...]) -> list[str]:
    """Float32 greedy texts of the in-process engine on ``model``."""
    config = EngineConfig(model=ModelConfig(model=model, dtype="float32"))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [output.text for output in LLM(config=config).generate(list(prompts), params)]


@pytest.mark.slow  # the routing per model is checked piece by piece below, on real etcd among them
@pytest.mark.timeout(300)
def test_two_models_behind_one_gateway(tmp_path: Path) -> None:
    tiny = save_random_model("tiny", tmp_path / "random-tiny", seed=3)
    lines: dict[str, str] = {}
    up_flags = (f"--extra-model={tiny}",)
    worker_flags = ("--dtype=float32", "--num-blocks=256", "--threads=1")
    with cluster(1, 1, *worker_flags, ready_lines=lines, up_flags=up_flags):
        expected = {
            "SmolLM2-135M-Instruct.Q4_1": _reference("default", PROMPTS),
            "random-tiny": _reference(str(tiny), TINY_PROMPTS),
        }
        url = lines["splitserve gateway ready"]
        tiny_coordinator = lines["splitserve model 1 ready"]

        async def scenario() -> None:
            api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            listed = await api.models.list()
            assert [card.id for card in listed.data] == list(expected)
            assert [card.max_model_len for card in listed.data] == [8192, 2048]  # type: ignore[attr-defined]
            asks = [
                (model, prompt)
                for model, prompts in zip(expected, (PROMPTS, TINY_PROMPTS), strict=True)
                for prompt in prompts
            ]
            answers = await asyncio.gather(
                *(
                    api.completions.create(
                        model=model,
                        prompt=prompt,
                        max_tokens=MAX_TOKENS,
                        temperature=0.0,
                        extra_body={"ignore_eos": True},
                    )  # fmt: skip
                    for model, prompt in asks
                )
            )
            got: dict[str, list[str]] = {model: [] for model in expected}
            for (model, _), answer in zip(asks, answers, strict=True):
                assert answer.model == model
                got[model].append(answer.choices[0].text)
            assert got == expected
            chat = await api.chat.completions.create(
                model="random-tiny",
                messages=[{"role": "user", "content": "t3 t4"}],
                max_tokens=4,
                temperature=0.0,
            )
            assert chat.model == "random-tiny" and chat.usage.completion_tokens >= 1
            with pytest.raises(openai.NotFoundError) as refused:
                await api.completions.create(model="no-such-model", prompt="x", max_tokens=1)
            assert refused.value.body["param"] == "model"  # type: ignore[index]
            assert refused.value.body["code"] == "model_not_found"  # type: ignore[index]

            # over gRPC: a coordinator serves its model only
            async with AsyncClient(tiny_coordinator) as client:
                info = await client.model_info()
                assert (info.model, info.checkpoint, info.max_model_len) == (
                    "random-tiny", "random-tiny", 2048,
                )  # fmt: skip
                with pytest.raises(ClientError) as wrong:
                    await client.generate("t5", model="SmolLM2-135M-Instruct.Q4_1")
                assert wrong.value.code is grpc.StatusCode.NOT_FOUND
                assert wrong.value.param == "model"
                done = await client.generate(
                    "t5 t6 t7 t8", model="random-tiny", sampling=_greedy(), timeout_s=60
                )
                assert done.text == expected["random-tiny"][0]

        asyncio.run(scenario())
        # the tiny model's coordinator holds its own worker only (the main one's internal
        # announcement is the last of its kind up printed: not the main coordinator's)
        remember_internal(tiny_coordinator, lines["splitserve model 1 internal ready"])
        assert set(worker_loads(tiny_coordinator)) == {
            "model1-dual-0-prefill",
            "model1-dual-0-decode",
        }


def _greedy() -> Sampling:
    return Sampling(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.mark.timeout(60)
def test_a_worker_of_another_model_is_refused_at_registration() -> None:
    credential = ClusterCredential.generate()

    async def scenario() -> None:
        registry = WorkerRegistry(model="model-a")
        servicer = MembershipServicer(registry)
        server = await start_server(
            "127.0.0.1",
            0,
            lambda s: (coordinator_pb2_grpc.add_MembershipServicer_to_server(servicer, s), [])[1],
            credential=credential,
            tls=None,
        )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            membership = coordinator_pb2_grpc.MembershipStub(channel)

            async def register(worker_id: str, model: str) -> None:
                info = WorkerInfo(worker_id, Role.DECODE, "127.0.0.1:1", LAYOUT, 64, 512, model)
                request = coordinator_pb2.RegisterWorkerRequest(
                    worker=convert.worker_info_to_proto(info)
                )
                await membership.RegisterWorker(request, metadata=credential.metadata)

            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await register("other", "model-b")
            assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "model-a" in refused.value.details() and "model-b" in refused.value.details()
            await register("own", "model-a")
            await register("unsaid", "")  # a worker from before WorkerInfo.model
            assert registry.get("other") is None
            assert registry.get("own") is not None and registry.get("unsaid") is not None
        await server.server.stop(None)

    asyncio.run(scenario())


def test_a_registry_accepts_its_own_model_only() -> None:
    def info(model: str) -> WorkerInfo:
        return WorkerInfo("w", Role.PREFILL, "127.0.0.1:1", LAYOUT, 64, 512, model)

    assert WorkerRegistry(model="a").accepts(info("a"))
    assert not WorkerRegistry(model="a").accepts(info("b"))
    assert WorkerRegistry(model="a").accepts(info(""))
    assert WorkerRegistry().accepts(info("b"))


def test_a_coordinator_answers_to_its_names_only() -> None:
    config = CoordinatorConfig(model_name="small", model_aliases=("s",), checkpoint="file")
    for asked in ("", "small", "s"):
        config.check_model(asked)
    for asked in ("file", "large"):
        with pytest.raises(Exception, match=f"`{asked}` does not exist") as error:
            config.check_model(asked)
        assert type(error.value).__name__ == "ModelNotFoundError"


def test_gateway_coordinator_targets_one_per_model() -> None:
    assert coordinator_targets(["a:1,a:2", "b:1"], {}) == ("a:1,a:2", "b:1")
    assert coordinator_targets(None, {"SPLITSERVE_COORDINATOR": "a:1;b:1,b:2"}) == (
        "a:1",
        "b:1,b:2",
    )
    assert coordinator_targets(None, {}) == ("127.0.0.1:50051",)


@pytest.mark.timeout(60)
def test_on_etcd_a_coordinator_passes_over_other_models_members(etcd: EtcdServer) -> None:
    """Workers of two models announce themselves in one etcd cluster; a coordinator's
    follower registers its own model's worker and not the other's."""

    async def scenario() -> None:
        announcers = []
        for worker_id, model in (("a-1", "model-a"), ("b-1", "model-b")):
            info = WorkerInfo(worker_id, Role.DECODE, "127.0.0.1:1", LAYOUT, 64, 512, model)
            announcer = EtcdAnnouncer(EtcdClient([etcd.endpoint]), "two-models", ttl_s=60)
            await announcer.announce(info)
            announcers.append(announcer)
        registry = WorkerRegistry(model="model-a")
        channels = WorkerChannels(ClusterAccess(ClusterCredential.generate()))
        watcher = EtcdMembershipWatcher(EtcdClient([etcd.endpoint], timeout_s=1.0), "two-models")
        follower = MembershipFollower(watcher, registry, channels)
        following = asyncio.create_task(follower.run())
        for _ in range(100):
            if registry.get("a-1") is not None:
                break
            await asyncio.sleep(0.05)
        assert registry.get("a-1") is not None
        assert registry.get("b-1") is None
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await following
        await channels.close()
        for announcer in announcers:
            await announcer.withdraw()

    asyncio.run(scenario())


def test_a_registry_refuses_an_adapter_name_with_other_files() -> None:
    """Two workers may serve an adapter under one name only with the same files (digest)."""

    def info(worker_id: str, *adapters: AdapterId) -> WorkerInfo:
        return WorkerInfo(
            worker_id, Role.DECODE, f"127.0.0.1:{len(worker_id)}", LAYOUT, 64, 512, "m",
            adapters=adapters,
        )  # fmt: skip

    registry = WorkerRegistry(model="m")
    registry.register(record_of(info("w1", AdapterId("a", "d1"), AdapterId("b", "d3"))))
    assert registry.accepts(info("w2", AdapterId("a", "d1")))
    assert registry.accepts(info("w1", AdapterId("a", "d2")))  # itself, registering again
    refusal = registry.refusal(info("w2", AdapterId("a", "d2")))
    assert refusal is not None and "'a'" in refusal and "w1" in refusal
    assert registry.adapter_names() == {"a", "b"}
    stranger = WorkerInfo("w3", Role.DECODE, "h:1", LAYOUT, 64, 512, "x")
    assert "model 'm'" in (registry.refusal(stranger) or "")


def test_the_gateway_learns_adapters_as_workers_bring_them() -> None:
    """A route asked before its workers registered (no adapters, a window of 0) is asked
    again when a request names a model it does not know, at most once per
    ``ADAPTERS_FRESH_S``; a name still unknown then is a 404."""
    from prometheus_client import CollectorRegistry

    from splitserve.client import ModelInfo
    from splitserve.gateway.errors import ApiError
    from splitserve.gateway.model_routes import ADAPTERS_FRESH_S, ModelRoute, ModelRoutes

    answers = [
        ModelInfo("base", 0, 100, (2,), ""),
        ModelInfo("base", 2048, 100, (2,), "bfloat16", adapters=("sql",)),
    ]
    asked: list[ModelInfo] = []

    class Client:
        async def model_info(self) -> ModelInfo:
            asked.append(answers[min(len(asked), 1)])
            return asked[-1]

    async def scenario() -> None:
        routes = ModelRoutes([ModelRoute("t", None, None)], CollectorRegistry())  # type: ignore[arg-type]
        route = await routes.route("base", lambda _: Client())  # type: ignore[arg-type,return-value]
        assert route.adapters == () and route.info is not None and route.info.max_model_len == 0
        route.adapters_asked_at -= ADAPTERS_FRESH_S  # a second later
        assert await routes.route("sql", lambda _: Client()) is route  # type: ignore[arg-type,return-value]
        assert route.info.max_model_len == 2048 and len(asked) == 2
        with pytest.raises(ApiError) as refused:
            await routes.route("nope", lambda _: Client())  # type: ignore[arg-type,return-value]
        assert refused.value.status == 404 and len(asked) == 2  # asked less than 1 s ago

    asyncio.run(scenario())
