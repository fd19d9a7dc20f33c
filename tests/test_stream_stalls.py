"""No silent stalls: a decode worker frozen with SIGSTOP under load (real ``splitserve up``
processes with simulated workers, real signals) answers nothing and drops no connection, yet
every stream it carried resumes on the other decode worker and completes, with the text an
uninterrupted run gives (a simulated worker's tokens do not depend on the path); the
coordinator counts each stall, and routing avoids the frozen worker (its breaker counts the
stalls as one incident: several streams stalling at once are one failure of one worker).
Likewise a frozen prefill worker: the prompts pushed to it bring no first token within their
limit and are computed on a decode worker. Before both, on the same cluster, ``splitserve
top --once`` shows every worker and the traffic of its interval."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.common.sampling_params import SamplingParams
from splitserve.common.step_cost import StepCost
from splitserve.engine.checkpoint import describe_checkpoint
from splitserve.engine.config import CacheConfig, EngineConfig, ModelConfig, RunnerConfig
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.sim_profile import SimProfile
from splitserve.engine.sim_runner import STAND_IN_HEAD_DIM
from splitserve.launch.child_process import ChildProcess, python_module_argv
from splitserve.proto.cluster_auth import TOKEN_ENV
from tests.cluster import (
    CREDENTIAL,
    child_pid,
    cluster,
    gateway_completions,
    internal_address,
    routable_members,
    transfer_figures,
    worker_loads,
)
from tests.waiting import until

PROMPTS = [f"Stream {i} tells of the mill by the river" for i in range(12)]
MAX_TOKENS = 80
STALL_ENV = {"SPLITSERVE_STALL_FLOOR_S": "1.0", "SPLITSERVE_STALL_FACTOR": "10"}
FROZEN_STREAMS = 3
"""Streams decoding on decode-1 when it is frozen: each of them must stall and resume."""


def _expected_texts(tmp_path: Path) -> list[str]:
    """Each prompt's text from an in-process simulated engine (whose step times do not change
    its tokens: a profile of near-zero steps keeps this quick)."""
    fast = StepCost(1e-5, 1e-6, 0.0, 1e-5, 1e-7, decode_steps=100, prefill_steps=100)
    profile = tmp_path / "fast.json"
    profile.write_text(SimProfile(fast, "test", "test", 1, "bfloat16", 200, 0.0).to_json())
    core = EngineCore(
        EngineConfig(
            model=ModelConfig(dtype="bfloat16"),
            cache=CacheConfig(num_blocks=256),
            runner=RunnerConfig(engine="sim", sim_profile=str(profile)),
        )
    )
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    for index, prompt in enumerate(PROMPTS):
        core.add_request(str(index), core.tokenizer.encode(prompt), _params())
    while core.has_unfinished:
        for output in core.step():
            tokens[output.update.request_id].extend(output.update.new_token_ids)
    return [core.tokenizer.decode(tokens[str(i)]) for i in range(len(PROMPTS))]


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def _counter(metrics_url: str, name: str) -> dict[str, float]:
    """Each sample of counter ``name`` by its label values in name order, model_name left
    out (``reason/role``, ``kind``)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    return {
        "/".join(v for k, v in sample.labels.items() if k != "model_name"): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == name
        for sample in family.samples
        if sample.name.endswith("_total")
    }


async def _serve_and_freeze(url: str, coordinator: str, decode_pid: int) -> list[str]:
    """Send every prompt at once, freeze decode-1 once ``FROZEN_STREAMS`` streams decode on
    it (as its heartbeat reports them)."""
    requests = asyncio.ensure_future(gateway_completions(url, PROMPTS, MAX_TOKENS))

    async def streams_decode_on_decode_1() -> bool:
        if requests.done():
            requests.result()  # a failed request raises here
            raise AssertionError("every stream completed before decode-1 was frozen")
        loads = await asyncio.to_thread(worker_loads, coordinator, {"decode-1"})
        return loads["decode-1"].num_running_requests >= FROZEN_STREAMS

    await until(streams_decode_on_decode_1, 60, f"{FROZEN_STREAMS} streams decoding on decode-1")
    os.kill(decode_pid, signal.SIGSTOP)
    return await requests


def _texts_with_a_frozen_worker(
    coordinator: str, lines: dict[str, str], processes: Sequence[subprocess.Popen[str]]
) -> tuple[list[str], set[str]]:
    """The streams' texts, and the workers routable once they completed (still frozen)."""
    decode_pid = child_pid(processes[0].pid, "--worker-id=decode-1")
    try:
        url = lines["splitserve gateway ready"]
        texts = asyncio.run(_serve_and_freeze(url, coordinator, decode_pid))
        return texts, routable_members(coordinator)
    finally:
        os.kill(decode_pid, signal.SIGCONT)  # so that the cluster stops cleanly


@dataclass(frozen=True)
class SimCluster:
    coordinator: str
    lines: dict[str, str]
    """What its processes announced (gateway URL, metrics URLs)."""
    processes: list[subprocess.Popen[str]]
    """``up``'s process."""


@pytest.fixture(scope="module")
def sim_cluster() -> Iterator[SimCluster]:
    """``splitserve up``: 1 prefill + 2 decode simulated workers, the gateway, stalls judged
    after 1 s (``STALL_ENV``)."""
    lines: dict[str, str] = {}
    processes: list[subprocess.Popen[str]] = []
    with cluster(
        1, 2, "--engine=sim", "--num-blocks=256", ready_lines=lines, processes=processes,
        env=STALL_ENV,
    ) as coordinator:  # fmt: skip
        yield SimCluster(coordinator, lines, processes)


def test_top_shows_every_worker_and_the_traffic_of_its_interval(sim_cluster: SimCluster) -> None:
    top = ChildProcess(
        python_module_argv(
            "splitserve.launch.top",
            f"--coordinator={internal_address(sim_cluster.coordinator)}",
            f"--metrics={sim_cluster.lines['coordinator metrics']}",
            "--once",
            "--interval=2",
        ),
        name="top",
        env={TOKEN_ENV: CREDENTIAL.token},
    )
    url = sim_cluster.lines["splitserve gateway ready"]
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    for prompt in PROMPTS[:4]:  # traffic inside top's interval
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
        httpx.post(f"{url}/v1/completions", json=body, timeout=60).raise_for_status()
    assert top.popen.wait(30) == 0, top.tail()
    top.stop(5)  # it has exited: this only collects the rest of its output
    frame = top.tail()
    assert "workers 3 routable of 3" in frame, frame
    rows = {line.split()[0]: line.split() for line in frame.splitlines() if line.strip()}
    for worker, role in (("prefill-0", "prefill"), ("decode-1", "decode"), ("decode-2", "decode")):
        assert rows[worker][1:3] == [role, "yes"], frame
    finished = re.search(r"finished ([0-9.]+) req/s +([0-9,]+) tok/s", frame)
    assert finished is not None and float(finished.group(1)) > 0, frame
    assert int(finished.group(2).replace(",", "")) > 0, frame


def test_streams_on_a_frozen_decode_worker_resume_and_complete(
    tmp_path: Path, sim_cluster: SimCluster
) -> None:
    expected = _expected_texts(tmp_path)
    lines = sim_cluster.lines
    sent_before = transfer_figures(lines["prefill metrics"], direction="send")
    texts, routable = _texts_with_a_frozen_worker(
        sim_cluster.coordinator, lines, sim_cluster.processes
    )
    sent = transfer_figures(lines["prefill metrics"], direction="send")
    stalls = _counter(lines["coordinator metrics"], "splitserve_stream_stalls")
    recoveries = _counter(lines["coordinator metrics"], "splitserve_request_recoveries")
    assert texts == expected  # every stream completed, each with its uninterrupted text
    # each prompt (under one 16-token block) was computed by the prefill worker, its stand-in
    # KV pushed over UCX: every layer's K and V of one block
    layers = describe_checkpoint("default").config.num_hidden_layers
    one_block = layers * 2 * 16 * STAND_IN_HEAD_DIM * 2
    assert sent.completed - sent_before.completed == len(PROMPTS) and sent.failures == 0
    assert sent.landed_bytes - sent_before.landed_bytes == len(PROMPTS) * one_block
    assert stalls["no_token/decode"] >= FROZEN_STREAMS  # the streams on the frozen worker
    assert recoveries["decode_resume"] == stalls["no_token/decode"]  # each resumed once
    # routing avoids it (failed, no heartbeat since), the others serve on
    assert routable == {"decode-2", "prefill-0"}


def test_prompts_pushed_to_a_frozen_prefill_worker_are_computed_on_a_decode_worker(
    tmp_path: Path, sim_cluster: SimCluster
) -> None:
    expected = _expected_texts(tmp_path)[:6]
    lines = sim_cluster.lines
    before = _counter(lines["coordinator metrics"], "splitserve_stream_stalls")
    fallbacks_before = _counter(lines["coordinator metrics"], "splitserve_request_recoveries")
    prefill_pid = child_pid(sim_cluster.processes[0].pid, "--worker-id=prefill-0")
    os.kill(prefill_pid, signal.SIGSTOP)
    try:
        texts = asyncio.run(
            gateway_completions(lines["splitserve gateway ready"], PROMPTS[:6], MAX_TOKENS)
        )
        routable = routable_members(sim_cluster.coordinator)
    finally:
        os.kill(prefill_pid, signal.SIGCONT)
    stalls = _counter(lines["coordinator metrics"], "splitserve_stream_stalls")
    fallbacks = _counter(lines["coordinator metrics"], "splitserve_request_recoveries")
    stalled = stalls["no_first_token/prefill"] - before["no_first_token/prefill"]
    assert texts == expected  # every prompt computed on a decode worker instead, same text
    assert stalled >= 1
    assert fallbacks["prefill_fallback"] - fallbacks_before["prefill_fallback"] == stalled
    assert "prefill-0" not in routable
