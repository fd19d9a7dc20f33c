"""``n > 1`` as one prompt forked (issue 32; ``gateway/choices.py``): a prompt's choices after
the first start once the first streamed, on the same decode worker (one session), and reuse
the prompt's full KV blocks from the prefix caches instead of computing and moving them again.

A float32 ``splitserve up`` cluster (a prefill and a decode worker, the gateway: the one of
``tests/test_serving_integration.py``, which calls ``assert_n_choices_fork``) gets one
completion of a fresh ~120-token prompt with ``n=4``, seeded sampling. Measured on the workers'
own metrics over that request: the prompt tokens computed (prefill and decode worker together)
are the prompt once plus at most a block's worth per further choice (four unforked choices
computed it four times), and the decode worker reused the prompt's full blocks for each
further choice. Each choice equals the
single-choice request with its seed (``seed + j``), token for token in float32. The same over
gRPC through the Python client's ``AsyncClient.generate_choices``, and its ``best_of``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator

import httpx
import pytest

from splitserve.client import AsyncClient, Chunk, Sampling, Usage
from splitserve.client.choices import merged
from tests.cluster import metric_total

BLOCK_TOKENS = 16
N = 4
SEED = 7
PROMPT = "The lighthouse keeper climbed the stairs each evening and counted them. " * 10


def _figures(urls: list[str]) -> dict[str, float]:
    """Prompt tokens computed and KV blocks reused, summed over the workers at ``urls``."""
    names = ("splitserve_prompt_tokens_total", "splitserve_kv_reused_blocks_total")
    return {name: sum(metric_total(url, name) for url in urls) for name in names}


async def _singles(url: str) -> list[str]:
    """The ``N`` single-choice requests of seeds ``SEED + j``, sent together (batched, as
    the forked choices are)."""
    answers = await asyncio.gather(*(_completions(url, 1, SEED + j) for j in range(N)))
    return [texts[0] for texts, _ in answers]


async def _completions(url: str, n: int, seed: int) -> tuple[list[str], int]:
    """The choices' texts (in index order) and the usage's prompt tokens."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        body = {
            "model": model,
            "prompt": PROMPT,
            "n": n,
            "seed": seed,
            "temperature": 0.8,
            "max_tokens": 8,
            "ignore_eos": True,
        }
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        answer = response.json()
    texts = [c["text"] for c in sorted(answer["choices"], key=lambda c: c["index"])]
    return texts, answer["usage"]["prompt_tokens"]


def _assert_forked(before: dict[str, float], after: dict[str, float], prompt_tokens: int) -> None:
    """Between the two metric readings: the prompt computed once, then each further choice
    only its last partial block; the others' full blocks reused."""
    computed, reused = (
        after[name] - before[name]
        for name in ("splitserve_prompt_tokens_total", "splitserve_kv_reused_blocks_total")
    )
    full_blocks = (prompt_tokens - 1) // BLOCK_TOKENS  # a prompt's last token is never cached
    tail = prompt_tokens - full_blocks * BLOCK_TOKENS
    # the prompt once, then each further choice only its last partial block (unforked: the
    # prompt N times, 4 x 121 tokens here, against 121 + 3 x 9)
    assert computed == prompt_tokens + (N - 1) * tail
    assert reused == (N - 1) * full_blocks


async def _grpc_choices(coordinator: str, worker_metrics: list[str]) -> None:
    """The Python client's ``generate_choices`` over gRPC: forked as through the gateway,
    each choice the single request with its seed; ``best_of`` keeps the candidates with the
    highest cumulative logprob, best first."""
    prompt = "The ferry crossed the bay twice a day and the captain logged the weather. " * 10
    sampling = Sampling(max_tokens=8, temperature=0.8, seed=SEED, ignore_eos=True)
    async with AsyncClient(coordinator, timeout_s=120) as client:
        before = _figures(worker_metrics)
        forked = await client.generate_choices(prompt, sampling=sampling, n=N)
        after = _figures(worker_metrics)
        _assert_forked(before, after, forked[0].usage.prompt_tokens)
        singles = await asyncio.gather(
            *(
                client.generate(prompt, sampling=dataclasses.replace(sampling, seed=SEED + j))
                for j in range(N)
            )
        )
        assert [g.token_ids for g in forked] == [g.token_ids for g in singles]
        assert len({g.token_ids for g in forked}) > 1
        best = await client.generate_choices(prompt, sampling=sampling, n=2, best_of=N)
        scores = {g.token_ids: sum(e.logprob for e in g.logprobs) for g in best}
        assert [g.token_ids for g in best] == sorted(scores, key=lambda t: -scores[t])
        with_logprobs = await client.generate_choices(
            prompt, sampling=dataclasses.replace(sampling, logprobs=0), n=N
        )
        ranked = sorted(with_logprobs, key=lambda g: -sum(e.logprob for e in g.logprobs))
        assert [g.token_ids for g in best] == [g.token_ids for g in ranked[:2]]


def assert_n_choices_fork(url: str, worker_metrics: list[str], coordinator: str = "") -> None:
    """Through the gateway at ``url`` of a float32 cluster whose workers serve /metrics at
    ``worker_metrics`` (prefill and decode): the module docstring's checks, with a prompt
    nothing has cached. Run inside ``tests/test_serving_integration.py``'s cluster."""
    before = _figures(worker_metrics)
    forked, prompt_tokens = asyncio.run(_completions(url, N, SEED))
    after = _figures(worker_metrics)
    singles = asyncio.run(_singles(url))
    assert forked == singles  # each choice is the single request with its seed
    assert len(set(forked)) > 1  # seeded sampling: the choices differ
    _assert_forked(before, after, prompt_tokens)
    if coordinator:  # the same over gRPC, through the Python client
        asyncio.run(_grpc_choices(coordinator, worker_metrics))


def test_followers_start_after_their_leaders_first_item() -> None:
    """``merged``'s gate: without leaders every stream starts at once; a follower starts
    only after its leader's first item, and after a leader that failed before any."""
    log: list[str] = []

    async def stream(index: int, fails: bool = False) -> AsyncGenerator[Chunk, None]:
        log.append(f"start {index}")
        await asyncio.sleep(0.01)
        if fails:
            raise RuntimeError("leader failed")
        log.append(f"item {index}")
        yield Chunk(f"c{index}", "x", (index,), (), Usage(1, 1, 0))

    async def run(leaders: list[int | None] | None, leader_fails: bool = False) -> None:
        log.clear()
        streams = [stream(0, leader_fails), stream(1), stream(2)]
        async for _ in merged(streams, leaders):
            pass

    asyncio.run(run(None))
    assert log[:3] == ["start 0", "start 1", "start 2"]
    asyncio.run(run([None, 0, 0]))
    assert log[:3] == ["start 0", "item 0", "start 1"] and "start 2" in log
    with pytest.raises(RuntimeError, match="leader failed"):
        asyncio.run(run([None, 0, 0], leader_fails=True))
