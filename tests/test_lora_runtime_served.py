"""LoRA adapters loaded and unloaded while a cluster serves, through the gateway's vLLM routes
(``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``): ``splitserve up`` with a prefill
and a decode worker started with ``--lora-dir`` and no adapter, float32, every prompt
computed on the prefill worker and its KV pushed to the decode worker
(``--placement=remote``), so both workers must have loaded the adapter.

A request naming an adapter loaded at runtime gets the in-process float32 engine's tokens
with that adapter (equal to PEFT's, ``tests/test_lora.py``), at once after the load's answer;
after the unload it is a 404, and the name loaded again from other files gives the other
adapter's tokens (none of the old files' KV), as do other files loaded in place
(``load_inplace``). Refusals are 4xx in OpenAI's shape naming the
field: a path outside ``--lora-dir``, a folder without an adapter, a name served with other
files, an unknown field, an unknown adapter to unload. The workers run with ``--max-loras=1``:
requests of two adapters sent together still get their own tokens.

On etcd (``tests/fault_cluster.py``: etcd, two coordinators, a prefill and a decode worker,
each process through its role's entry point): an adapter loaded through one coordinator
outlives it. That coordinator killed and the decode worker killed and started again without
the adapter, the other coordinator gives it the adapter (it read the record in etcd) and
serves its requests with the engine's tokens; the first, started again, unloads it, and a
decode worker started again after that is given nothing.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
import httpx
import pytest

from splitserve.client import AsyncClient, ClientError, Sampling
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.checkpoint import LoadedCheckpoint
from tests.cluster import cluster, served_adapters, worker_loads
from tests.conftest import make_llm
from tests.fault_cluster import FaultCluster
from tests.lora_adapters import completion_token_ids

openai = pytest.importorskip("openai")

TOKENS = 10
PROMPT = "Once upon a time, in a small village by the sea,"


@pytest.fixture(scope="module")
def expected(default_checkpoint_fp32: LoadedCheckpoint, lora_adapters) -> dict[str, list[int]]:
    """The in-process float32 engine's greedy tokens of ``PROMPT`` by adapter ("": none)."""
    llm = make_llm(
        default_checkpoint_fp32,
        lora_modules=tuple((name, str(saved.folder)) for name, saved in lora_adapters.items()),
    )
    names = ("", *lora_adapters)
    params = [
        SamplingParams(max_tokens=TOKENS, min_tokens=TOKENS, temperature=0.0, adapter=name)
        for name in names
    ]
    prompt = default_checkpoint_fp32.tokenizer.encode(PROMPT)
    results = llm.generate([prompt] * len(names), params)
    return {name: result.token_ids for name, result in zip(names, results, strict=True)}


@pytest.mark.slow  # 35 s; the routes, the admin check and the workers' refusal also run in
# tests/test_public_security.py, the engine's runtime changes in tests/test_lora_runtime.py
def test_adapters_loaded_and_unloaded_while_serving(lora_adapters, expected) -> None:
    assert expected["every"] != expected[""] != expected["qv"]
    root = Path(lora_adapters["every"].folder).parent
    lines: dict[str, str] = {}
    flags = ("--dtype=float32", "--num-blocks=256", "--threads=1", f"--lora-dir={root}")
    flags += ("--max-loras=1",)  # requests of a second adapter wait, parked with their KV
    with cluster(1, 1, *flags, ready_lines=lines, up_flags=("--placement=remote",)) as address:
        url = lines["splitserve gateway ready"]
        asyncio.run(_check(url, address, expected, root))


async def _check(url: str, address: str, expected: dict[str, list[int]], root: Path) -> None:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    async with client, httpx.AsyncClient(base_url=url, timeout=120) as http:

        async def tokens(model: str, stream: bool = False) -> list[int]:
            return await completion_token_ids(client, model, PROMPT, TOKENS, stream)

        async def load(name: str, path: str, **extra: object) -> httpx.Response:
            body = {"lora_name": name, "lora_path": path, **extra}
            return await http.post("/v1/load_lora_adapter", json=body)

        async def unload(name: str) -> httpx.Response:
            return await http.post("/v1/unload_lora_adapter", json={"lora_name": name})

        with pytest.raises(openai.NotFoundError):
            await tokens("tuned")
        loaded = await load("tuned", "every")  # relative to --lora-dir
        assert loaded.status_code == 200, loaded.text
        assert loaded.text == "Success: LoRA adapter 'tuned' added successfully."
        # routed at once, on both workers (the prompt is computed on the prefill worker)
        got = await asyncio.gather(tokens("tuned"), tokens("tuned", stream=True))
        assert got == [expected["every"]] * 2
        models = {model.id: model for model in (await client.models.list()).data}
        assert "tuned" in models and models["tuned"].model_extra["parent"] is not None
        base = models["tuned"].model_extra["parent"]
        assert await tokens(base) == expected[""]

        refusals = {
            "outside": (await load("x", "/etc"), 400, "lora_path"),
            "not an adapter": (await load("x", str(root)), 400, "lora_path"),
            "other files": (await load("tuned", str(root / "qv")), 400, "lora_name"),
            "unknown field": (await load("x", "every", lora_rank=8), 400, None),
            "unknown adapter": (await unload("nope"), 404, None),
        }
        for what, (response, status, param) in refusals.items():
            assert response.status_code == status, (what, response.text)
            error = response.json()["error"]
            assert error["message"], what
            if param is not None:
                assert error["param"] == param, (what, error)
        assert await tokens("tuned") == expected["every"]  # the refusals changed nothing

        # vLLM's load_inplace (RL trainers swap a policy's adapter so): the other files
        # serve the next request on both workers, and back again
        swapped = await load("tuned", str(root / "qv"), load_inplace=True)
        assert swapped.status_code == 200, swapped.text
        assert await tokens("tuned") == expected["qv"]
        assert (await load("tuned", "every", load_inplace=True)).status_code == 200
        assert await tokens("tuned", stream=True) == expected["every"]

        removed = await unload("tuned")
        assert removed.status_code == 200, removed.text
        with pytest.raises(openai.NotFoundError):
            await tokens("tuned")
        # the name again, other files: the other adapter's tokens, none of the old KV
        assert (await load("tuned", str(root / "qv"))).status_code == 200
        assert await tokens("tuned") == expected["qv"]

        # --max-loras=1: requests of two adapters and of the base model sent together each
        # get their own tokens (the decode worker parks the second adapter's, KV pushed)
        assert (await load("every-too", "every")).status_code == 200
        models = ["tuned", "every-too", base, "every-too", "tuned"]
        got = await asyncio.gather(*(tokens(m, stream=i % 2 == 1) for i, m in enumerate(models)))
        answers = {"tuned": expected["qv"], "every-too": expected["every"], base: expected[""]}
        assert got == [answers[m] for m in models]

    async with AsyncClient(address, timeout_s=120) as grpc_client:
        assert "tuned" in (await grpc_client.model_info()).adapters
        assert await grpc_client.unload_lora_adapter("tuned") == 2  # both worker processes
        loaded_again = await grpc_client.load_lora_adapter("again", "every")
        assert loaded_again.name == "again" and loaded_again.workers == 2
        with pytest.raises(ClientError) as refused:
            await grpc_client.load_lora_adapter("bad", "../escape")
        assert refused.value.param == "lora_path"


def _served_by(coordinator: str, worker_id: str) -> set[str]:
    """The adapters' names ``coordinator`` knows the worker to serve (none: not registered)."""
    return served_adapters(coordinator).get(worker_id, set())


def _wait_for(predicate, what: str, timeout_s: float = 60.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


async def _grpc_tokens(address: str, model: str, prompt: list[int]) -> list[int]:
    sampling = Sampling(max_tokens=TOKENS, min_tokens=TOKENS, temperature=0.0)
    async with AsyncClient(address, timeout_s=120) as client:
        generation = await client.generate(token_ids=prompt, sampling=sampling, model=model)
    return list(generation.token_ids)


async def _load(address: str, name: str, path: str) -> int:
    async with AsyncClient(address, timeout_s=120) as client:
        return (await client.load_lora_adapter(name, path)).workers


async def _unload(address: str, name: str) -> int:
    async with AsyncClient(address, timeout_s=120) as client:
        return await client.unload_lora_adapter(name)


def _restart(process) -> None:  # noqa: ANN001
    process.send(signal.SIGKILL)
    process.wait_exit(10)
    process.start()


@pytest.mark.slow  # a cluster of its own on etcd, three restarts
@pytest.mark.timeout(600)
def test_an_adapter_loaded_on_etcd_outlives_the_coordinator_that_loaded_it(
    lora_adapters, expected, default_checkpoint_fp32: LoadedCheckpoint, tmp_path: Path
) -> None:
    root = Path(lora_adapters["every"].folder).parent
    prompt = default_checkpoint_fp32.tokenizer.encode(PROMPT)
    flags = ("--dtype=float32", "--num-blocks=256", "--threads=1", "--metrics-port=-1")
    with FaultCluster.start(tmp_path, 2, 1, 1, (*flags, f"--lora-dir={root}")) as fleet:
        first, second = fleet.coordinators
        decode = fleet.named("decode-0")
        assert asyncio.run(_load(first.address, "tuned", "every")) == 2

        first.send(signal.SIGKILL)  # the coordinator that loaded it dies ...
        first.wait_exit(10)
        _restart(decode)  # ... and a worker comes back without the adapter
        _wait_for(lambda: "tuned" in _served_by(second.address, "decode-0"), "the reload")
        assert asyncio.run(_grpc_tokens(second.address, "tuned", prompt)) == expected["every"]

        first.start()  # reads the record: it knows the adapter, and unloads it everywhere
        _wait_for(lambda: "tuned" in _served_by(first.address, "decode-0"), "the first's view")
        _wait_for(lambda: "tuned" in _served_by(first.address, "prefill-0"), "the first's view")
        assert asyncio.run(_unload(first.address, "tuned")) == 2
        _wait_for(lambda: not _served_by(second.address, "decode-0"), "the unload's report")
        with pytest.raises(ClientError) as refused:
            asyncio.run(_grpc_tokens(second.address, "tuned", prompt))
        assert refused.value.code == grpc.StatusCode.NOT_FOUND

        _restart(decode)  # nobody gives it the unloaded adapter
        _wait_for(lambda: "decode-0" in worker_loads(second.address), "the decode worker")
        time.sleep(3.0)  # three of the coordinators' rounds of giving newcomers adapters
        assert not _served_by(second.address, "decode-0")
        assert not _served_by(first.address, "decode-0")
        assert asyncio.run(_grpc_tokens(second.address, "", prompt)) == expected[""]
