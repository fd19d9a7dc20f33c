"""Session affinity end to end (issue 33): requests carrying the gateway's ``x-session-id``
header go to their session's home decode worker (``coordinator/router.py:session_home``).

A ``splitserve up`` cluster (a coordinator, a prefill and two decode workers with simulated
engines, the gateway) gets a conversation's turns for two sessions whose homes differ,
interleaved, one at a time: each decode worker finishes exactly the turns of the session
homed on it (counted from the workers' own reports). Without session ids the same idle
workers would be chosen by load alone, so the split is the sessions' doing. A session id
longer than the gateway allows is a 400 naming the header.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from splitserve.common.membership import Role
from splitserve.coordinator.router import session_home
from tests.cluster import cluster, worker_loads
from tests.test_router import _worker

pytestmark = pytest.mark.timeout(300)

DECODE_WORKERS = ("decode-1", "decode-2")
TURNS = 3


def _sessions_homed_apart() -> dict[str, str]:
    """Two session ids, one homed on each decode worker: {session: its home}."""
    records = [_worker(worker_id, Role.DECODE) for worker_id in DECODE_WORKERS]
    homes: dict[str, str] = {}
    for i in range(100):
        home = session_home(f"chat-{i}", records).worker_id
        if home not in homes.values():
            homes[f"chat-{i}"] = home
        if len(homes) == len(DECODE_WORKERS):
            return homes
    raise AssertionError("no two sessions with different homes")


async def _turns(url: str, sessions: list[str]) -> None:
    """``TURNS`` turns of each session, interleaved, each after the previous one ended."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        history = {session: [] for session in sessions}
        for turn in range(TURNS):
            for session in sessions:
                history[session].append({"role": "user", "content": f"Turn {turn}: go on."})
                body = {"model": model, "messages": history[session], "max_tokens": 4}
                response = await client.post(
                    "/v1/chat/completions", json=body, headers={"x-session-id": session}
                )
                assert response.status_code == 200, response.text
                reply = response.json()["choices"][0]["message"]["content"]
                history[session].append({"role": "assistant", "content": reply})
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        response = await client.post(
            "/v1/chat/completions", json=body, headers={"x-session-id": "s" * 257}
        )
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "x-session-id"


@pytest.mark.slow  # a cluster of its own; tests/test_router.py covers the routing decisions
def test_a_sessions_turns_go_to_its_home_decode_worker() -> None:
    homes = _sessions_homed_apart()
    lines: dict[str, str] = {}
    with cluster(1, 2, "--engine=sim", ready_lines=lines) as address:
        before = worker_loads(address, set(DECODE_WORKERS))
        asyncio.run(_turns(lines["splitserve gateway ready"], list(homes)))
        after = worker_loads(address, set(DECODE_WORKERS))
    finished = {
        worker: after[worker].num_finished_requests - before[worker].num_finished_requests
        for worker in DECODE_WORKERS
    }
    assert finished == {home: TURNS for home in homes.values()}
