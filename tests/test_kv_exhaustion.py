"""KV exhaustion through the real stack (``splitserve up``: coordinator, 1 prefill + 1 decode
worker with 64 KV blocks of 16 tokens, gateway), 200 concurrent streaming completions of
distinct 512-token prompts (each needs 34 of the 64 blocks with its 32 output tokens, so one
runs at a time) sent at once over HTTP.

Contract (issue 17): every answer is 200 or 429, never a 5xx; admitted streams complete and
keep their time per output token within 2x of the same request's unloaded figure; refused
ones get 429 with an OpenAI error body and a Retry-After within 1 s of sending; nothing
stalls (the whole burst ends within its bound), and afterwards every block is free and a
normal request is served.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.cluster import assert_all_free, cluster, wait_until_idle

NUM_BLOCKS = 64
PROMPT_TOKENS = 512
MAX_TOKENS = 32
CONCURRENT = 200
UNLOADED_RUNS = 3
BURST_TIMEOUT_S = 600.0


@dataclass
class Outcome:
    status: int
    answered_after_s: float
    """From sending to the response's status line."""
    token_times: list[float] = field(default_factory=list)
    """When each chunk with text came (one chunk may carry several tokens: drafts)."""
    tokens: int = 0
    """The completion tokens its usage chunk reported."""
    retry_after: str | None = None
    error_type: str | None = None

    @property
    def tpot_s(self) -> float:
        """The time per output token after the first chunk."""
        if len(self.token_times) < 2 or self.tokens < 2:
            return 0.0
        return (self.token_times[-1] - self.token_times[0]) / (self.tokens - 1)

    @property
    def whole(self) -> bool:
        return self.status == 200 and self.tokens == MAX_TOKENS


def _prompt(rng: random.Random) -> list[int]:
    """Distinct token ids: no prefix-cache hits between requests."""
    return [rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)]


async def _complete(client: httpx.AsyncClient, url: str, model: str, prompt: list[int]) -> Outcome:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    started = time.monotonic()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        outcome = Outcome(response.status_code, time.monotonic() - started)
        if response.status_code != 200:
            payload = json.loads(await response.aread())
            outcome.retry_after = response.headers.get("retry-after")
            outcome.error_type = payload["error"]["type"]
            return outcome
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: ") :])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    outcome.token_times.append(time.monotonic())
                if chunk.get("usage"):
                    outcome.tokens = chunk["usage"]["completion_tokens"]
    return outcome


async def _burst(url: str, model: str, prompts: list[list[int]]) -> list[Outcome]:
    limits = httpx.Limits(max_connections=len(prompts) + 10)
    async with httpx.AsyncClient(timeout=BURST_TIMEOUT_S, limits=limits) as client:
        return list(await asyncio.gather(*(_complete(client, url, model, p) for p in prompts)))


def _served_model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_kv_exhaustion_admits_what_fits_and_refuses_the_rest_at_once() -> None:
    rng = random.Random(17)
    lines: dict[str, str] = {}
    with cluster(1, 1, f"--num-blocks={NUM_BLOCKS}", ready_lines=lines) as coordinator:
        url = lines["splitserve gateway ready"]
        model = _served_model(url)
        unloaded = [
            asyncio.run(_burst(url, model, [_prompt(rng)]))[0] for _ in range(UNLOADED_RUNS)
        ]
        assert all(o.whole for o in unloaded), [
            (o.status, o.error_type, o.tokens) for o in unloaded
        ]
        unloaded_tpot = statistics.median(o.tpot_s for o in unloaded)

        started = time.monotonic()
        outcomes = asyncio.run(_burst(url, model, [_prompt(rng) for _ in range(CONCURRENT)]))
        burst_s = time.monotonic() - started

        admitted = [o for o in outcomes if o.status == 200]
        refused = [o for o in outcomes if o.status == 429]
        tpots = sorted(o.tpot_s for o in admitted)
        refusal_times = sorted(o.answered_after_s for o in refused)
        print(
            f"\nKV exhaustion: {len(admitted)} admitted, {len(refused)} refused (429), "
            f"{len(outcomes) - len(admitted) - len(refused)} other, burst {burst_s:.1f} s; "
            f"TPOT unloaded {unloaded_tpot * 1000:.1f} ms, admitted median "
            f"{statistics.median(tpots) * 1000:.1f} ms, max {tpots[-1] * 1000:.1f} ms; "
            f"429 after median {statistics.median(refusal_times) * 1000:.0f} ms, "
            f"max {refusal_times[-1] * 1000:.0f} ms"
        )
        assert [o.status for o in outcomes if o.status not in (200, 429)] == []
        assert admitted and refused
        assert all(o.whole for o in admitted)
        assert tpots[-1] <= 2 * unloaded_tpot
        assert refusal_times[-1] < 1.0
        assert all(o.error_type and o.retry_after and int(o.retry_after) >= 1 for o in refused)

        assert_all_free(wait_until_idle(coordinator, 2), 2)
        after = asyncio.run(_burst(url, model, [_prompt(rng)]))[0]
        assert after.whole
