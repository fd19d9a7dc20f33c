"""The layout re-checked from served steps (``launch/layout_recheck.py``): the running layout's
phase times read from the workers' learned step models, the model's choice on them, and
``splitserve up`` doing it against a real coordinator (simulated engines, real gRPC), writing
the served times back to the probe's cache."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest

from splitserve.client.async_client import AsyncClient
from splitserve.client.types import Sampling
from splitserve.common.kv_layout import KvLayout
from splitserve.common.layout_probe import BATCH, PhaseTimes, ProbeResult
from splitserve.common.load import EngineLoad
from splitserve.common.membership import MemberStatus, Role, WorkerInfo
from splitserve.common.step_cost import StepCost
from splitserve.launch.layout import Workload, capacity, choose, comparable, probe_cache_path
from splitserve.launch.layout_recheck import (
    MIN_DECODE_STEPS,
    MIN_PROMPT_STEPS,
    recheck,
    served_phase,
    with_served,
)
from tests.cluster import running

CHAT = Workload()
PROMPT = 320


def _probe(half: PhaseTimes, whole: PhaseTimes) -> ProbeResult:
    return ProbeResult(
        cpu="test", cores=2, dtype="float32", prompt_tokens=PROMPT, phases=(half, whole), probe_s=1
    )


LAYOUT = KvLayout(
    model="m", dtype="float32", block_size=16, num_layers=2, num_kv_heads=1, head_dim=8
)


def _member(role: Role, cost: StepCost, worker_id: str = "w") -> MemberStatus:
    info = WorkerInfo(f"{worker_id}-{role.value}", role, "127.0.0.1:1", LAYOUT, 64, 1024)
    return MemberStatus(
        info=info, load=EngineLoad(step_cost=cost), ready=True, ms_since_heartbeat=0, routable=True
    )


def _cost(prompt_s: float, decode_one_s: float, per_request_s: float) -> StepCost:
    """A learned model whose PROMPT-token prompt takes ``prompt_s`` and whose decode step of
    one request ``decode_one_s`` (context costs nothing), each part known."""
    return StepCost(
        decode_base_s=decode_one_s - per_request_s,
        per_decode_seq_s=per_request_s,
        per_prefill_token_s=prompt_s / PROMPT,
        decode_steps=MIN_DECODE_STEPS,
        prefill_steps=MIN_PROMPT_STEPS,
    )


PROBED = _probe(
    PhaseTimes(1, prefill_s=1.2, decode_one_s=0.018, decode_batch_s=0.060),
    PhaseTimes(2, prefill_s=0.4, decode_one_s=0.012, decode_batch_s=0.025),
)
"""All cores far ahead of half of them: ``choose`` runs aggregated on the probe alone."""


def test_the_served_phase_reads_prompts_from_prefill_members_and_steps_from_decode_ones() -> None:
    prefill = _member(Role.PREFILL, _cost(1.0, 0.5, 0.5))  # its decode part: not read
    decode = _member(Role.DECODE, _cost(9.0, 0.020, 0.004))  # its prompt part: not read
    served = served_phase(PROBED, "split", [prefill, decode])
    assert served is not None
    assert served.threads == 1
    assert served.prefill_s == pytest.approx(1.0)
    assert served.decode_one_s == pytest.approx(0.020)
    assert served.decode_batch_s == pytest.approx(0.020 + 0.004 * (BATCH - 1))
    assert served_phase(PROBED, "aggregated", [prefill, decode]).threads == 2  # type: ignore[union-attr]


def test_nothing_is_served_until_both_parts_saw_enough_steps() -> None:
    known = _cost(1.0, 0.020, 0.004)
    young = StepCost(decode_base_s=0.02, decode_steps=MIN_DECODE_STEPS - 1, prefill_steps=0)
    assert served_phase(PROBED, "split", [_member(Role.DECODE, known)]) is None  # no prefill
    members = [_member(Role.PREFILL, known), _member(Role.DECODE, young)]
    assert served_phase(PROBED, "split", members) is None
    assert recheck(PROBED, CHAT, "split", members) is None


def test_aggregated_served_far_slower_than_probed_turns_the_choice_to_the_worker_pair() -> None:
    """What happened on the 2-core Cascade Lake Xeon: the probe chose aggregated, and its
    served decode steps took 45 / 54 ms (1 / 8 requests) against the probe's 13 / 36."""
    dual = _cost(0.80, 0.045, (0.054 - 0.045) / (BATCH - 1))
    members = [_member(Role.PREFILL, dual, "dual"), _member(Role.DECODE, dual, "dual")]
    result = recheck(PROBED, CHAT, "aggregated", members)
    assert result is not None
    assert result.switch and result.choice.layout == "hybrid"
    assert result.probe.served == (2,)
    assert result.probe.half_cores == PROBED.half_cores  # split keeps the probe's times
    line = result.line()
    assert "hybrid" in line and "(probe)" in line and "(served)" in line
    assert "next `splitserve up` starts it" in line


def test_a_layout_served_as_probed_stays() -> None:
    members = [
        _member(Role.PREFILL, _cost(0.40, 0.5, 0.5), "dual"),
        _member(Role.DECODE, _cost(0.40, 0.012, (0.025 - 0.012) / (BATCH - 1)), "dual"),
    ]
    result = recheck(PROBED, CHAT, "aggregated", members)
    assert result is not None and not result.switch
    assert "aggregated stays the choice" in result.line()


PAIR_AHEAD = _probe(
    PhaseTimes(1, prefill_s=0.8, decode_one_s=0.022, decode_batch_s=0.050),
    PhaseTimes(2, prefill_s=0.5, decode_one_s=0.018, decode_batch_s=0.036),
)
"""The two layouts probed about even (0.82 req/s each): ``choose`` runs the pair."""


def _pair_served(slower: float) -> list[MemberStatus]:
    """The pair's members served ``slower`` times each of ``PAIR_AHEAD``'s 1-thread times."""
    half = PAIR_AHEAD.half_cores
    per_request = half.decode_per_request_s * slower
    return [
        _member(Role.PREFILL, _cost(half.prefill_s * slower, 0.5, 0.5)),
        _member(Role.DECODE, _cost(9.0, half.decode_one_s * slower, per_request)),
    ]


def test_a_pair_served_slower_than_probed_charges_aggregated_the_same_and_stays() -> None:
    """What happened on the Cascade Lake Xeon (2026-11-28): the pair served long prompts, its
    served times (everything else on the cores, 1,400-token prompts' fit) set beside
    ``aggregated``'s quiet probe, and the next ``up`` started ``aggregated`` for chat. Each
    time served 1.6x its probe: beside the bare probe ``aggregated`` would be over twice the
    pair's rate; charged the same serving cost, it is not."""
    result = recheck(PAIR_AHEAD, CHAT, "hybrid", _pair_served(1.6))
    assert result is not None
    uncarried = [capacity(result.probe, CHAT, layout) for layout in ("hybrid", "aggregated")]
    assert uncarried[1] >= 2.0 * uncarried[0] > 0.0  # the comparison the fix replaces
    assert result.choice.layout == "hybrid" and not result.switch
    probe, carried = comparable(result.probe)
    assert [(cost.source, cost.target) for cost in carried] == [(1, 2)]
    assert carried[0].prefill == pytest.approx(1.6)
    assert carried[0].decode_one == pytest.approx(1.6)
    assert carried[0].decode_batch == pytest.approx(1.6)
    assert probe.all_cores.prefill_s == pytest.approx(1.6 * PAIR_AHEAD.all_cores.prefill_s)
    assert probe.half_cores == result.probe.half_cores  # the served side as served
    assert "probe x the serving cost on 1 thread(s)" in result.line()
    assert "the 2-thread probe x the 1-thread engine's served/probed" in result.choice.reason


def test_nothing_is_carried_once_both_layouts_were_served_nor_down_from_aggregated() -> None:
    both = with_served(
        with_served(PAIR_AHEAD, PhaseTimes(1, 1.2, 0.03, 0.07)), PhaseTimes(2, 0.6, 0.02, 0.04)
    )
    assert comparable(both) == (both, ())
    assert choose(both, CHAT).capacities == tuple(
        (layout, capacity(both, CHAT, layout)) for layout in ("hybrid", "aggregated")
    )
    aggregated_only = with_served(PAIR_AHEAD, PhaseTimes(2, 0.6, 0.045, 0.054))
    assert comparable(aggregated_only) == (aggregated_only, ())


def test_served_times_round_trip_through_the_cache_marked_served() -> None:
    served = PhaseTimes(1, prefill_s=1.5, decode_one_s=0.03, decode_batch_s=0.07)
    once = with_served(PROBED, served)
    twice = with_served(once, PhaseTimes(2, 0.9, 0.05, 0.06))
    assert once.served == (1,) and twice.served == (1, 2)
    assert twice.half_cores == served
    assert twice.probed == PROBED.phases  # the probe's own times kept beside the served ones
    again = with_served(twice, PhaseTimes(1, 2.0, 0.04, 0.08))
    assert again.probed == PROBED.phases and again.half_cores.prefill_s == 2.0
    assert ProbeResult.from_json(json.loads(json.dumps(twice.to_json()))) == twice
    assert "(served)" in twice.describe()
    with pytest.raises(ValueError):
        ProbeResult(
            cpu="x", cores=2, dtype="f", prompt_tokens=1, phases=PROBED.phases, probe_s=1,
            served=(3,),
        )  # fmt: skip
    older = twice.to_json()
    del older["probed"]  # a cache written before the probe's own times were kept
    with pytest.raises(ValueError):
        ProbeResult.from_json(older)


@pytest.mark.slow  # the re-check's rules are unit-tested above
def test_up_rechecks_a_named_layout_from_a_real_clusters_served_steps(tmp_path: Path) -> None:
    """``up --layout split`` with simulated engines and this machine's probe cached (written
    by the test): once the workers' models know both phases, ``up`` lists them from the
    coordinator (real gRPC, the cluster credential) and writes split's served times back to
    the cache, marked served, the probe's own kept beside them; aggregated's stay the
    probe's."""
    worker_flags = ["--engine=sim", "--num-blocks=256", "--max-model-len=1024"]
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    saved = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path)
    try:
        path = probe_cache_path(worker_flags, CHAT)
    finally:
        if saved is None:
            del os.environ["XDG_CACHE_HOME"]
        else:
            os.environ["XDG_CACHE_HOME"] = saved
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(PROBED.to_json()))
    argv = [
        "splitserve.launch.up",
        "--port=0",
        "--internal-port=0",
        "--no-gateway",
        "--metrics-port-base=-1",
        "--layout=split",
        "--layout-recheck-s=0.5",
        "--",
        *worker_flags,
    ]
    with running(argv, env=env) as address:

        async def load() -> None:
            async with AsyncClient(address, timeout_s=60) as client:
                await client.wait_ready(timeout_s=30)
                params = Sampling(max_tokens=24, ignore_eos=True)
                prompts = [f"prompt {i} " * 20 for i in range(3 * MIN_PROMPT_STEPS)]
                for start in range(0, len(prompts), 4):
                    batch = prompts[start : start + 4]
                    await asyncio.gather(*(client.generate(p, sampling=params) for p in batch))

        asyncio.run(load())
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            cached = ProbeResult.from_json(json.loads(path.read_text()))
            if cached.served:
                break
            time.sleep(0.2)
    assert cached.served == (1,), "up wrote no served times"
    assert cached.all_cores == PROBED.all_cores
    assert cached.half_cores != PROBED.half_cores
    assert cached.probed == (PROBED.half_cores,)  # the probe's own times kept beside them
