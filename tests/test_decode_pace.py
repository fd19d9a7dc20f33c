"""A decode worker holding its steps back for the prefill worker beside it
(``engine/decode_pace.py``): when it holds, what it publishes (``common/busy_flag.py``), how
the borrower takes the held time (``engine/step_threads.py``), the engine thread's loop
(``engine/async_engine.py``), and the flags that set it (``worker/runtime.py``,
``launch/up.py``)."""

from __future__ import annotations

import asyncio
import os
import statistics
import threading
import time
from pathlib import Path

import pytest
import torch

from splitserve.common.busy_flag import BusyFlag, BusyFlagReader
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine import step_threads as step_threads_module
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.checkpoint import LoadedCheckpoint
from splitserve.engine.decode_pace import DecodePace
from splitserve.engine.engine_report import EngineReport
from splitserve.engine.step_threads import BorrowedCores, StepThreads
from splitserve.launch import up
from tests.conftest import assert_no_leaks, make_llm


class _Partner:
    """The prefill worker's state as the decode worker reads it, set by the test."""

    def __init__(self, busy: bool = True) -> None:
        self.busy = busy
        self.until = 0.0

    def is_busy(self) -> bool:
        return self.busy

    def idle_until(self) -> float:
        return self.until


def test_a_decode_only_step_is_held_to_one_per_interval_while_the_partner_is_busy() -> None:
    partner = _Partner()
    pace = DecodePace(0.025, partner)
    assert pace.hold_s(10.010, 10.0, prompt_work=False) == pytest.approx(0.015)
    assert pace.hold_s(10.030, 10.0, prompt_work=False) == 0.0  # the interval is over
    assert pace.hold_s(10.010, 10.0, prompt_work=True) == 0.0  # a prompt waits: step now
    assert pace.hold_s(10.010, None, prompt_work=False) == 0.0  # no step yet
    partner.busy = False  # nobody would use the held time
    assert pace.hold_s(10.010, 10.0, prompt_work=False) == 0.0
    with pytest.raises(ValueError, match="positive"):
        DecodePace(0.0, partner)


def test_the_busy_flag_publishes_until_when_its_owner_idles(tmp_path: Path) -> None:
    path = tmp_path / "decode.busy"
    owner, reader = BusyFlag(path), BusyFlagReader(path)
    owner.set(False, idle_until=123.5)
    assert not reader.is_busy() and reader.idle_until() == 123.5
    owner.set(False)  # idle until work comes
    assert reader.idle_until() == 0.0
    owner.set(False, idle_until=124.0)
    owner.set(True)
    assert reader.is_busy()
    old = tmp_path / "old.busy"  # an older owner's one-byte file has no time
    old.write_bytes(b"\x00")
    old_reader = BusyFlagReader(old)
    assert not old_reader.is_busy() and old_reader.idle_until() == 0.0


class _Clock:
    """``time.monotonic`` for ``engine/step_threads.py``, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def _sizes(
    step_threads: StepThreads, clock: _Clock, layers: list[tuple[float, float]]
) -> list[int]:
    """torch's pool size at one step's start and after each layer boundary; ``layers``: per
    boundary, the seconds the layer before it took and the owner's idle spell end then
    (seconds after that boundary; 0.0: no end published, -1: busy). On a thread of its own,
    as the engine's."""
    owner = step_threads.borrows.owner if step_threads.borrows else None
    assert isinstance(owner, _Partner)
    sizes: list[int] = []

    def step() -> None:
        owner.busy = True
        step_threads.before_step()
        sizes.append(torch.get_num_threads())
        for layer_s, spell_s in layers:
            clock.now += layer_s
            owner.busy = spell_s < 0
            owner.until = clock.now + spell_s if spell_s > 0 else 0.0
            step_threads.between_layers()
            sizes.append(torch.get_num_threads())
        step_threads.after_step(0.3, 0.3)

    thread = threading.Thread(target=step)
    thread.start()
    thread.join()
    return sizes


def test_a_prompt_step_takes_the_held_time_only_where_its_next_layer_fits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Layers of 10 ms on the own core: a spell of 20 ms takes the borrowed core (a layer
    there is taken to last 7.5 ms), one of 5 ms does not; a borrowed layer of 6 ms gives the
    core back where 4 ms of the spell are left; a later spell in the same step is taken
    again (the owner said when it comes back, so there is no thrash to fear)."""
    clock = _Clock()
    monkeypatch.setattr(step_threads_module, "time", clock)
    partner = _Partner()
    step_threads = StepThreads(own_threads=1, borrows=BorrowedCores(frozenset({0}), partner))
    layers = [
        (0.010, -1),  # owner busy
        (0.010, 0.005),  # a spell too short for a layer: stay
        (0.010, 0.020),  # long enough: take it
        (0.006, 0.004),  # 4 ms left, a borrowed layer takes 6: give it back
        (0.010, -1),
        (0.010, 0.030),  # the next spell: take it again
        (0.006, 0.0),  # the owner idles without an end: keep it
    ]
    assert _sizes(step_threads, clock, layers) == [1, 1, 1, 2, 1, 1, 2, 2]
    assert (step_threads.grown_steps, step_threads.yielded_steps) == (2, 1)
    # a step that begins in a spell too short for the first layer (as long as the last own
    # layer: 10 ms, so 7.5 ms borrowed) begins on its own core
    partner.busy, partner.until = False, clock.now + 0.005
    step_threads.before_step()
    assert torch.get_num_threads() == 1 and step_threads.borrowed_steps == 0
    step_threads.after_step(0.3, 0.3)


@pytest.fixture
def engine_parts(default_checkpoint_fp32: LoadedCheckpoint, tmp_path: Path):
    """An offline engine, the decode worker's published flag and a reader of it."""
    llm = make_llm(default_checkpoint_fp32, num_blocks=128)
    flag_path = tmp_path / "decode.busy"
    yield (
        llm,
        StepThreads(own_threads=torch.get_num_threads(), lends=BusyFlag(flag_path)),
        (BusyFlagReader(flag_path)),
    )
    assert_no_leaks(llm)


def _decode_step_starts(engine: AsyncEngine) -> list[float]:
    """When each decode-only step of ``engine`` ended, from its reports."""
    ends: list[float] = []

    def listen(report: EngineReport) -> None:
        step = report.step
        if step is not None and step.shape is not None and step.shape.prefill_tokens == 0:
            ends.append(time.monotonic())

    engine.add_report_listener(listen)
    return ends


def test_the_engine_holds_decode_steps_while_the_partner_is_busy_and_the_tokens_stay(
    engine_parts,
) -> None:
    """Through the engine thread: with the partner busy, decode steps come one per interval
    and the flag says idle until the next; the greedy tokens are those of the unpaced engine;
    with the partner idle, steps follow at once."""
    llm, step_threads, reader = engine_parts
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompt = llm.encode_prompt("The three primary colours are")
    [expected] = llm.generate([prompt], params)
    interval = 0.4  # a float32 decode step of the reference ops: about 0.1 s on 2 cores
    partner = _Partner(busy=True)
    engine = AsyncEngine(
        llm.engine, step_threads=step_threads, decode_pace=DecodePace(interval, partner)
    )
    spells: list[float] = []
    sampling = threading.Event()

    def sample_flag() -> None:
        while not sampling.is_set():
            if not reader.is_busy() and reader.idle_until():
                spells.append(reader.idle_until() - time.monotonic())
            time.sleep(0.005)

    async def run(request_id: str) -> list[int]:
        tokens: list[int] = []
        async for output in engine.generate(request_id, prompt, params):
            tokens.extend(output.update.new_token_ids)
        return tokens

    try:
        ends = _decode_step_starts(engine)
        sampler = threading.Thread(target=sample_flag)
        sampler.start()
        paced = asyncio.run(run("paced"))
        sampling.set()
        sampler.join()
        paced_gaps = [b - a for a, b in zip(ends, ends[1:], strict=False)]
        holds = engine.paced_holds
        partner.busy = False
        ends.clear()
        unpaced = asyncio.run(run("unpaced"))
        unpaced_gaps = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    finally:
        engine.shutdown()
    assert paced == unpaced == list(expected.token_ids)
    assert holds >= 3 and engine.paced_s > interval
    assert min(paced_gaps) > 0.8 * interval, paced_gaps  # step ends a step's spread apart
    assert statistics.median(unpaced_gaps) < interval / 2, unpaced_gaps
    assert spells and max(spells) <= interval and min(spells) >= 0.0 - 0.01, spells


def test_a_prompt_arriving_while_a_step_is_held_is_computed_at_once(engine_parts) -> None:
    """A held decode step waits for nothing that has work: a new request's prompt ends the
    hold, and its first token comes long before the interval would have."""
    llm, step_threads, _reader = engine_parts
    interval = 2.0
    engine = AsyncEngine(
        llm.engine, step_threads=step_threads, decode_pace=DecodePace(interval, _Partner())
    )
    long_run = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    async def scenario() -> float:
        first = engine.generate("held", llm.encode_prompt("Count with me: one, two,"), long_run)
        await anext(first)  # its prompt step and first token; its next step is held
        await asyncio.sleep(0.1)
        started = time.monotonic()
        async for _ in engine.generate("new", llm.encode_prompt("Hello"), one):
            pass
        waited = time.monotonic() - started
        async for _ in first:
            pass
        return waited

    try:
        waited = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert waited < interval / 2, waited


def _decode_flags(monkeypatch: pytest.MonkeyPatch, *flags: str) -> list[str]:
    monkeypatch.setattr(up.os, "sched_getaffinity", lambda _pid: set(range(2)))
    args = up.build_parser().parse_args(list(flags))
    _prefill, (_name, decode) = up.worker_argvs(args, "127.0.0.1:50052", [], busy_dir="/b")
    return [flag for flag in decode if flag.startswith("--pace-decode-ms")]


def test_up_paces_the_decode_worker_of_a_pair_that_lends_both_ways(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--core-lending both`` (hybrid): half the layout workload's ITL target by default;
    not where the prefill worker borrows nothing, nor with a share of 0."""
    monkeypatch.delenv("SPLITSERVE_PACE_DECODE_SHARE", raising=False)
    assert _decode_flags(monkeypatch, "--core-lending=both") == ["--pace-decode-ms=25"]
    assert _decode_flags(
        monkeypatch, "--core-lending=both", "--layout-workload=1400,100,4000,80"
    ) == ["--pace-decode-ms=40"]
    assert _decode_flags(monkeypatch, "--core-lending=decode") == []
    assert _decode_flags(monkeypatch, "--core-lending=both", "--pace-decode-share=0") == []
    monkeypatch.setenv("SPLITSERVE_PACE_DECODE_SHARE", "0")
    assert _decode_flags(monkeypatch, "--core-lending=both") == []
    args = up.build_parser().parse_args(["--pace-decode-share=1.5"])
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        up.decode_pace_ms(args)


def test_a_worker_refuses_pacing_it_cannot_use(tmp_path: Path) -> None:
    """``--pace-decode-ms`` without a partner's cores to lend the held time to, or on a
    prefill-only worker: a usage error naming the flag, before the model loads."""
    import subprocess
    import sys

    from splitserve.proto.cluster_auth import TOKEN_ENV
    from tests.cluster import CREDENTIAL

    for module in ("splitserve.decode.main", "splitserve.prefill.main"):
        done = subprocess.run(
            [sys.executable, "-m", module, "--port=0", "--pace-decode-ms=25"],
            env={**os.environ, TOKEN_ENV: CREDENTIAL.token},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, done.stderr[-2000:]
        assert "--pace-decode-ms" in done.stderr and "Traceback" not in done.stderr
