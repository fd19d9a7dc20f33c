"""LoRA adapters served end to end: ``splitserve up`` with a prefill and a decode worker that
both load two PEFT adapters, float32, every prompt computed on the prefill worker and its KV
pushed to the decode worker (``--placement=remote``).

Through the gateway with the openai SDK, a request names an adapter as its ``model``; its
tokens equal the in-process float32 engine's with that adapter (which equals PEFT's,
``tests/test_lora.py``), whole and streamed, on completions and chat, while requests of the
other adapter and of the base model run at the same time. ``/v1/models`` lists the adapters
with their base model as parent; a name nothing serves is a 404 naming ``model``; the
coordinator's gRPC ``GetModelInfo`` lists the adapters too. Prefix-cached KV is kept apart per
adapter: the same long prompt asked under the base model after an adapter is not served from
the adapter's blocks.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from splitserve.client import AsyncClient
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.checkpoint import LoadedCheckpoint
from tests.cluster import cluster
from tests.conftest import make_llm
from tests.lora_adapters import completion_token_ids

openai = pytest.importorskip("openai")

TOKENS = 12
PROMPTS = ("The capital of France is", "Once upon a time, in a small village by the sea,")


@pytest.fixture(scope="module")
def adapter_folders(lora_adapters) -> dict[str, Path]:
    return {name: saved.folder for name, saved in lora_adapters.items()}


@pytest.fixture(scope="module")
def expected(
    default_checkpoint_fp32: LoadedCheckpoint, adapter_folders
) -> dict[tuple[str, str], list[int]]:
    """The in-process float32 engine's greedy tokens, by (adapter or "", prompt)."""
    llm = make_llm(
        default_checkpoint_fp32,
        lora_modules=tuple((name, str(folder)) for name, folder in adapter_folders.items()),
    )
    tokenizer = default_checkpoint_fp32.tokenizer
    keys = [(name, prompt) for name in ("", *adapter_folders) for prompt in PROMPTS]
    params = [
        SamplingParams(max_tokens=TOKENS, min_tokens=TOKENS, temperature=0.0, adapter=name)
        for name, _ in keys
    ]
    results = llm.generate([tokenizer.encode(prompt) for _, prompt in keys], params)
    return {key: result.token_ids for key, result in zip(keys, results, strict=True)}


@pytest.mark.slow  # 15 s; tests/test_lora_runtime_served.py (slow) serves adapters the same way
def test_adapters_served_through_the_gateway(adapter_folders, expected) -> None:
    modules = ",".join(f"{name}={folder}" for name, folder in adapter_folders.items())
    lines: dict[str, str] = {}
    flags = ("--dtype=float32", "--num-blocks=256", "--threads=1", f"--lora-modules={modules}")
    with cluster(1, 1, *flags, ready_lines=lines, up_flags=("--placement=remote",)) as address:
        url = lines["splitserve gateway ready"]
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        asyncio.run(_check_served(client, url, expected))
        asyncio.run(_check_grpc(address))


async def _check_served(client, url: str, expected: dict[tuple[str, str], list[int]]) -> None:
    async with client:
        models = {model.id: model for model in (await client.models.list()).data}
        base = next(name for name, model in models.items() if model.model_extra["parent"] is None)
        assert {models["every"].model_extra["parent"], models["qv"].model_extra["parent"]} == {base}

        asks = [
            (adapter, prompt, stream)
            for adapter in ("", "every", "qv")
            for prompt in PROMPTS
            for stream in (False, True)
        ]
        got = await asyncio.gather(
            *(
                completion_token_ids(client, adapter or base, prompt, TOKENS, stream)
                for adapter, prompt, stream in asks
            )
        )
        for (adapter, prompt, stream), tokens in zip(asks, got, strict=True):
            assert tokens == expected[(adapter, prompt)], (adapter, prompt, stream)

        chat = await client.chat.completions.create(
            model="every", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
            temperature=0,
        )  # fmt: skip
        assert chat.model == "every" and chat.choices[0].message.content

        async with httpx.AsyncClient(base_url=url) as http:
            missing = await http.post(
                "/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 1}
            )
        assert missing.status_code == 404, missing.text
        assert missing.json()["error"]["param"] == "model"

        # the base model after an adapter, on a long prompt: nothing of the adapter's KV is
        # reused for it (its tokens stay the base model's)
        long_prompt = " ".join(PROMPTS) * 12
        first = await client.completions.create(
            model="every", prompt=long_prompt, max_tokens=1, temperature=0
        )
        again = await client.completions.create(
            model="every", prompt=long_prompt, max_tokens=1, temperature=0
        )
        other = await client.completions.create(
            model=base, prompt=long_prompt, max_tokens=1, temperature=0
        )
        cached = [_cached_tokens(response) for response in (first, again, other)]
        assert cached[0] == 0 and cached[1] > 64 and cached[2] == 0, cached


def _cached_tokens(response) -> int:
    details = response.usage.prompt_tokens_details
    return 0 if details is None else details.cached_tokens or 0


async def _check_grpc(address: str) -> None:
    async with AsyncClient(address, timeout_s=60) as client:
        info = await client.model_info()
    assert set(info.adapters) == {"every", "qv"}
