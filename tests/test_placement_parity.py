"""Outside-in: greedy float32 output is the same wherever a request's prompt is computed.

One prefill and one decode worker (float32, KV over UCX) registered with three coordinators,
each with another ``--placement``: ``local`` (every prompt on the decode worker), ``remote``
(every prompt on the prefill worker, pushed), ``adaptive`` (per request from the workers'
learned step-time models; with a 1 ms TTFT target every remote prefill is "at risk", so it
takes the decode worker whenever that is predicted faster). Every request's tokens equal the
in-process float32 engine's; each coordinator's placement counter shows where its prompts
ran; the workers report their learned step-time models; no block is left held.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.client import AsyncClient, ClientError, LatencyTargets, Sampling
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.checkpoint import LoadedCheckpoint
from tests.cluster import (
    ProcessSpec,
    assert_all_free,
    internal_address,
    running_together,
    wait_until_idle,
    worker_loads,
)
from tests.conftest import make_llm

pytestmark = pytest.mark.timeout(600)

WORKER_FLAGS = ("--dtype=float32", "--num-blocks=400", "--threads=1", "--metrics-port=-1")
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea. " * 3,
    "Once upon a time, in a land far away, there lived " * 6,
    "def fibonacci(n):\n    " * 10,
]
MAX_TOKENS = 5
"""Enough tokens that each output crosses the KV handoff and several decode steps."""
MODES = {
    "local": ("--placement=local",),
    "remote": ("--placement=remote",),
    "adaptive": ("--placement=adaptive", "--ttft-slo-ms=1", "--tpot-slo-ms=10000"),
}


def _placements(metrics_url: str) -> dict[tuple[str, str], float]:
    """(where, reason) -> decisions, from a coordinator's /metrics."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        (sample.labels["where"], sample.labels["reason"]): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "splitserve_placement_decisions"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


def _reference(checkpoint: LoadedCheckpoint) -> list[tuple[int, ...]]:
    """Each prompt's greedy tokens from the in-process float32 engine."""
    llm = make_llm(checkpoint)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
    return [tuple(out.token_ids) for out in llm.generate(PROMPTS, params)]


def _coordinators(
    stack: contextlib.ExitStack, modes: dict[str, tuple[str, ...]]
) -> tuple[dict[str, str], dict[str, str]]:
    """One coordinator per mode (its flags), running until ``stack`` closes: their public
    addresses and metrics URLs by mode."""
    lines: dict[str, dict[str, str]] = {mode: {} for mode in modes}
    specs = [
        ProcessSpec(
            ["splitserve.coordinator.main", "--port=0", "--internal-port=0", *flags],
            "splitserve coordinator ready at",
            lines[mode],
        )
        for mode, flags in modes.items()
    ]
    started = stack.enter_context(running_together(specs))
    addresses = dict(zip(modes, started, strict=True))
    return addresses, {mode: lines[mode]["coordinator metrics"] for mode in modes}


def _workers(
    stack: contextlib.ExitStack, workers: list[tuple[list[str], str, str]], internals: str
) -> None:
    """Each (module and its own flags, worker id, ready marker) as a worker of every
    coordinator (``internals``), started together, running until ``stack`` closes."""
    specs = [
        ProcessSpec(
            [*command, "--port=0", f"--worker-id={worker_id}", f"--coordinator={internals}"]
            + list(WORKER_FLAGS),
            marker,
        )
        for command, worker_id, marker in workers
    ]
    stack.enter_context(running_together(specs))


async def _generate(
    address: str, rounds: int, targets: LatencyTargets | None = None
) -> list[tuple[int, ...]]:
    """Every prompt, one at a time, ``rounds`` times (later rounds: the models are known),
    each asking for ``targets``."""
    sampling = Sampling(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = []
    async with AsyncClient(address) as client:
        for _ in range(rounds):
            for prompt in PROMPTS:
                generation = await client.generate(prompt, sampling=sampling, targets=targets)
                outputs.append(generation.token_ids)
    return outputs


@pytest.mark.slow  # 30-40 s: rounds enough to teach both workers' step-time models. Remote
# prefill's parity runs in the default suite (test_serving_integration), the adaptive decision
# and per-request targets on their own (test_placement)
def test_every_placement_gives_the_reference_tokens(
    default_checkpoint_fp32: LoadedCheckpoint,
) -> None:
    expected = _reference(default_checkpoint_fp32)
    with contextlib.ExitStack() as stack:
        addresses, metrics = _coordinators(stack, MODES)
        internals = ",".join(internal_address(a) for a in addresses.values())
        roles = ("prefill", "decode")
        workers = [([f"splitserve.{r}.main"], f"{r}-0", f"splitserve {r} ready at") for r in roles]
        _workers(stack, workers, internals)
        for address in addresses.values():
            _wait_for_workers(address, 2)

        for mode in ("local", "remote", "adaptive"):  # local and remote teach the models
            rounds = 3 if mode == "adaptive" else 2
            assert asyncio.run(_generate(addresses[mode], rounds)) == expected * rounds, mode

        asked = 2 * len(PROMPTS)
        assert _placements(metrics["local"]) == {("local", "forced"): asked}
        assert _placements(metrics["remote"]) == {("remote", "forced"): asked}
        adaptive = _placements(metrics["adaptive"])
        assert sum(adaptive.values()) == 3 * len(PROMPTS)
        assert set(adaptive) <= {
            ("remote", "no_model"),
            ("remote", "remote_faster"),
            ("local", "local_faster"),
        }, adaptive
        # the prefill worker's steps also push KV: the decode worker is predicted faster
        assert adaptive.get(("local", "local_faster"), 0) > 0, adaptive

        # a request's own TTFT target (10 minutes) replaces the coordinator's 1 ms: no remote
        # prefill is at risk, so every prompt goes remote, unless the decode worker holds
        # its start (computed there before) and the prefill worker does not: then it computes
        # the rest itself; a negative target is refused
        relaxed = LatencyTargets(ttft_ms=600_000)
        assert asyncio.run(_generate(addresses["adaptive"], 1, relaxed)) == expected
        after = _placements(metrics["adaptive"])
        relaxed_decisions = {
            key: count - adaptive.get(key, 0)
            for key, count in after.items()
            if count > adaptive.get(key, 0)
        }
        assert set(relaxed_decisions) <= {
            ("remote", "remote_within_slo"),
            ("local", "local_cached"),
        }, relaxed_decisions
        assert sum(relaxed_decisions.values()) == len(PROMPTS), relaxed_decisions
        with pytest.raises(ClientError) as refused:
            asyncio.run(_generate(addresses["adaptive"], 1, LatencyTargets(tpot_ms=-1)))
        assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert "tpot_ms" in refused.value.message

        loads = wait_until_idle(addresses["local"], 2)
        assert_all_free(loads, 2)
        for worker_id, load in worker_loads(addresses["remote"]).items():
            cost = load.step_cost
            assert cost.prefill_steps >= len(PROMPTS) and cost.per_prefill_token_s > 0, worker_id
        assert worker_loads(addresses["local"])["decode-0"].step_cost.decode_steps > 0


DUAL_MODES = {"remote": ("--placement=remote",), "local": ("--placement=local",)}


@pytest.mark.slow  # 20 s; dual-role workers start in the default suite too (test_core_lending)
def test_dual_role_workers_give_the_reference_tokens_pushing_to_each_other(
    default_checkpoint_fp32: LoadedCheckpoint,
) -> None:
    """Two dual-role workers (``splitserve worker --roles prefill,decode``, float32, KV over
    UCX): with ``remote`` placement each prompt is computed on the other worker and pushed
    (never to the worker itself: its own prefill role is not a candidate), with ``local`` on
    the worker that decodes it. Concurrent requests, every output equal to the in-process
    engine's; each worker registered as two members; no block left held on either."""
    expected = _reference(default_checkpoint_fp32)
    with contextlib.ExitStack() as stack:
        addresses, metrics = _coordinators(stack, DUAL_MODES)
        internals = ",".join(internal_address(a) for a in addresses.values())
        dual = ["splitserve.launch.dual_worker", "--roles=prefill,decode"]
        ready = "splitserve prefill+decode ready at"
        _workers(stack, [(dual, f"dual-{index}", ready) for index in range(2)], internals)
        members = {f"dual-{i}-{role}" for i in range(2) for role in ("prefill", "decode")}
        for address in addresses.values():
            _wait_for_workers(address, len(members))
            assert set(worker_loads(address)) == members

        for mode in DUAL_MODES:
            outputs = asyncio.run(_generate_concurrently(addresses[mode], rounds=2))
            assert outputs == expected * 2, mode

        asked = 2 * len(PROMPTS)
        assert _placements(metrics["remote"]) == {("remote", "forced"): asked}
        assert _placements(metrics["local"]) == {("local", "forced"): asked}
        assert_all_free(wait_until_idle(addresses["remote"], len(members)), len(members))
        for worker_id, load in worker_loads(addresses["remote"]).items():
            # both computed pushed prompts for the other and decoded
            assert load.step_cost.prefill_steps > 0 and load.step_cost.decode_steps > 0, worker_id


async def _generate_concurrently(address: str, rounds: int) -> list[tuple[int, ...]]:
    """Every prompt ``rounds`` times, all at once; outputs in prompt order."""
    sampling = Sampling(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    async with AsyncClient(address) as client:
        results = await asyncio.gather(
            *(
                client.generate(prompt, sampling=sampling)
                for _ in range(rounds)
                for prompt in PROMPTS
            )
        )
    return [result.token_ids for result in results]


def _wait_for_workers(address: str, count: int) -> None:
    deadline = time.monotonic() + 240
    while len(worker_loads(address)) < count:
        assert time.monotonic() < deadline, "the workers did not register"
        time.sleep(0.2)
