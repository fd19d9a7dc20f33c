"""A worker's measured profile (``splitserve profile``, ``engine/sim_profile.py``) and what a
simulated worker does with it: its KV transfers paced on the measured link
(``transfer/paced.py``), the link measured between two real processes over UCX
(``transfer/link_probe.py``)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from splitserve.common.errors import ModelLoadError
from splitserve.common.step_cost import StepShape
from splitserve.engine.sim_profile import (
    DEFAULT_PROFILE,
    PROFILE_VERSION,
    RATIO_QUANTILES,
    SimProfile,
    StepRecord,
    fit_step_cost,
    load_profile,
    step_ratio_quantiles,
)
from splitserve.engine.sim_runner import SimulatedRunner
from splitserve.transfer.inprocess import InProcessTransport
from splitserve.transfer.link_probe import measure_link
from splitserve.transfer.paced import LinkModel, PacedTransport

ROOT = Path(__file__).resolve().parent.parent


def test_a_version_1_profile_reads_with_no_link_and_a_newer_one_is_refused(
    tmp_path: Path,
) -> None:
    shipped = load_profile("default")
    assert "version" not in json.loads(DEFAULT_PROFILE.read_text())  # written before versions
    assert shipped.version == 1 and shipped.transfer_gbps == 0 and shipped.transfer_s(4096) == 0
    measured = dataclasses.replace(
        shipped,
        version=PROFILE_VERSION,
        kv_bytes_per_token=10_000,
        transfer_gbps=8.0,
        transfer_latency_s=0.001,
        startup_s=12.5,
    )
    assert SimProfile.from_json(measured.to_json()) == measured
    # 1,000 tokens of 10 kB at 8 Gbit/s: 10 ms, after 1 ms of latency
    assert measured.transfer_s(1000) == pytest.approx(0.011)
    future = json.loads(measured.to_json()) | {"version": PROFILE_VERSION + 1}
    with pytest.raises(ModelLoadError, match="reads up to version"):
        SimProfile.from_json(json.dumps(future))


def test_a_simulated_engine_scales_its_stand_in_kv_to_the_real_models() -> None:
    profile = dataclasses.replace(
        load_profile("default"), kv_bytes_per_token=23_040, transfer_gbps=10.0
    )
    runner = SimulatedRunner(profile, [5, 6], num_layers=30, num_blocks=4, block_size=16)
    link = runner.link_model()
    assert link is not None
    # the stand-in: 30 layers x K and V x 1 head x 2 values x 2 bytes = 240 bytes a token
    assert link.bytes_scale == pytest.approx(23_040 / 240)
    assert (link.gbps, link.latency_s) == (10.0, 0.0)
    unmeasured = SimulatedRunner(load_profile("default"), [5], 30, 4, 16)
    assert unmeasured.link_model() is None


def test_paced_sends_share_the_link_one_after_another() -> None:
    """Two 1,000-byte sends, each standing for 100 kB on a 0.08 Gbit/s link (10 ms each) with
    5 ms of latency: the first lands after at least 15 ms, the second after at least 25 ms
    (it waited for the first); the bytes arrive unchanged."""
    link = LinkModel(gbps=0.08, latency_s=0.005, bytes_scale=100.0)

    async def scenario() -> tuple[float, float, bool]:
        sender, receiver = PacedTransport(InProcessTransport(), link), InProcessTransport()
        endpoint = await sender.connect(receiver.address)
        loop = asyncio.get_running_loop()
        started = loop.time()
        landed: list[float] = []
        buffers = [torch.empty(1000, dtype=torch.uint8) for _ in range(2)]

        async def receive(tag: int, buffer: torch.Tensor) -> None:
            await receiver.recv(tag, buffer)
            landed.append(loop.time() - started)

        payload = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
        await asyncio.gather(
            receive(1, buffers[0]),
            receive(2, buffers[1]),
            endpoint.send(1, payload),
            endpoint.send(2, payload),
        )
        same = all(torch.equal(buffer, payload) for buffer in buffers)
        return landed[0], landed[1], same

    first, second, same = asyncio.run(scenario())
    assert same
    assert first >= 0.015 and second >= 0.025
    assert sender_name_is_the_backends()


def sender_name_is_the_backends() -> bool:
    """The handshake compares transport names: pacing must not change it."""
    inner = InProcessTransport()
    return PacedTransport(inner, LinkModel(1.0, 0.0, 1.0)).name == inner.name


def test_the_link_between_two_real_processes_is_measured() -> None:
    ucxx = pytest.importorskip("ucxx", reason="UCX (ucxx) is not installed here")
    try:
        link = asyncio.run(measure_link(count=4, size=1 << 20, pings=10))
    finally:
        ucxx.reset()  # one ucxx context per process: the next UCX test makes its own
    assert link.gbps > 0 and 0 < link.latency_s < 1.0
    assert link.transports


def _profile(out: Path, *flags: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """``splitserve profile --out=out *flags``, which must succeed."""
    done = subprocess.run(
        [sys.executable, "-m", "splitserve.launch.cli", "profile", f"--out={out}", *flags],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    return done


@pytest.mark.slow  # a real engine's start-up and steps (11 s); the profile's format is tested above
def test_splitserve_profile_writes_a_versioned_profile(tmp_path: Path) -> None:
    """The command end to end, on a served worker's step logs (fitting a real engine is the
    slow test below) and a link given as measured elsewhere."""
    logs = tmp_path / "steps"
    logs.mkdir()
    header = {"model": "m", "dtype": "float32", "threads": 1, "cpu": "c", "engine": "model"}
    header["kv_bytes_per_token"] = 46_080
    lines = [json.dumps(header)]
    for step in range(200):  # decode steps of 1-8 requests and prompt steps, both kinds in
        decode = [1 + step % 8, 0, 300 + step, 0.01 + 0.002 * (1 + step % 8)]  # each half
        prefill = [0, 64 + step, 0, 0.05 + 0.001 * (64 + step)]
        lines += [json.dumps(shape) for shape in (decode, prefill, prefill, decode)]
    (logs / "steps-1.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "profile.json"
    done = _profile(out, f"--from-steps={logs}", "--transfer-gbps=25", "--transfer-latency-ms=0.2")
    profile = load_profile(out)
    assert profile.version == PROFILE_VERSION
    assert (profile.kv_bytes_per_token, profile.transfer_gbps) == (46_080, 25.0)
    assert profile.transfer_latency_s == pytest.approx(0.0002)
    assert profile.step_cost.per_prefill_token_s == pytest.approx(0.001, rel=0.05)
    assert "wrote" in done.stdout and "given" in done.stdout


@pytest.mark.slow  # fits the real engine (about a minute) and times a start-up
def test_splitserve_profile_measures_this_machine(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    _profile(out, timeout_s=900)
    profile = load_profile(out)
    assert profile.kv_bytes_per_token > 0 and profile.transfer_gbps > 0
    assert profile.startup_s > 0 and profile.step_cost.knows_decode


def test_a_simulated_step_draws_its_ratio_from_the_real_steps_spread() -> None:
    """Real decode steps of 10 ms with every tenth at 50 ms: the least-squares model predicts
    their mean, 14 ms; the ratios' quantiles put the median draw at 10 ms and the top one at
    50 ms, so simulated steps spread as the real ones did."""
    shape = StepShape(2, 0, 300)
    decode = [StepRecord(shape, 0.05 if i % 10 == 9 else 0.01) for i in range(200)]
    prompts = [
        StepRecord(StepShape(0, 64 * (1 + i % 8), 0), 0.02 + 0.064 * (1 + i % 8)) for i in range(40)
    ]
    records = decode + prompts
    cost = fit_step_cost(records)
    quantiles = step_ratio_quantiles(cost, records)
    assert len(quantiles) == RATIO_QUANTILES and list(quantiles) == sorted(quantiles)
    profile = dataclasses.replace(
        load_profile("default"),
        step_cost=cost,
        step_ratio_quantiles=quantiles,
        prefill_ratio_quantiles=step_ratio_quantiles(cost, records, computes_prompt=True),
    )
    assert cost.step_s(shape) == pytest.approx(0.014, rel=0.01)
    median = profile.draw_ratio(0.5) * cost.step_s(shape)
    top = profile.draw_ratio(0.999) * cost.step_s(shape)
    assert median == pytest.approx(0.01, rel=0.15) and top == pytest.approx(0.05, rel=0.15)
    assert profile.draw_ratio(0.5, computes_prompt=True) == pytest.approx(1.0, rel=0.05)
    assert load_profile("default").draw_ratio(0.9) == 1.0  # a profile without the spread
