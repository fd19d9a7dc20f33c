"""Core lending between co-located workers: the busy flag one worker publishes and another
reads (``common/busy_flag.py``), the per-step thread count that follows from it
(``engine/step_threads.py``), the worker flags (``worker/process.py``) and ``up``'s pairing
(``launch/up.py``)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from splitserve.client.sync_client import Client
from splitserve.client.types import Sampling
from splitserve.common import busy_flag
from splitserve.common.busy_flag import BusyFlag, BusyFlagReader
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine import step_threads as step_threads_module
from splitserve.engine.checkpoint import LoadedCheckpoint
from splitserve.engine.config import CacheConfig, EngineConfig, ModelConfig, RunnerConfig
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.random_checkpoint import SHAPES, random_checkpoint
from splitserve.engine.step_threads import BorrowedCores, StepThreads
from splitserve.launch import up
from splitserve.proto.cluster_auth import TOKEN_ENV
from splitserve.worker.process import add_worker_args, borrowed_cpus
from splitserve.worker.runtime import step_threads_of
from tests.cluster import CREDENTIAL, cluster
from tests.conftest import make_llm


def test_a_reader_sees_the_owners_state_and_reads_busy_until_the_file_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(busy_flag, "REOPEN_INTERVAL_S", 0.0)
    path = tmp_path / "prefill.busy"
    reader = BusyFlagReader(path)
    assert reader.is_busy()  # no owner yet: do not borrow
    owner = BusyFlag(path)
    assert reader.is_busy()  # an owner starts busy (it is loading its model)
    owner.set(False)
    assert not reader.is_busy()
    owner.set(True)
    assert reader.is_busy()


def test_a_missing_file_is_retried_at_most_once_per_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(busy_flag, "REOPEN_INTERVAL_S", 3600.0)
    path = tmp_path / "prefill.busy"
    reader = BusyFlagReader(path)
    assert reader.is_busy()
    BusyFlag(path).set(False)
    assert reader.is_busy()  # not retried within the interval
    monkeypatch.setattr(busy_flag, "REOPEN_INTERVAL_S", 0.0)
    reader._next_open_at = 0.0
    assert not reader.is_busy()


def test_a_restarted_owner_says_busy_through_the_mapping_a_reader_already_holds(
    tmp_path: Path,
) -> None:
    path = tmp_path / "prefill.busy"
    first = BusyFlag(path)
    reader = BusyFlagReader(path)
    first.set(False)
    assert not reader.is_busy()
    BusyFlag(path)  # the owner came back: same file, busy while it loads
    assert reader.is_busy()


def test_an_owner_in_another_process_is_read_after_it_exits(tmp_path: Path) -> None:
    """Killed while idle leaves idle (its cores are free); while busy leaves busy."""
    path = tmp_path / "prefill.busy"
    reader = BusyFlagReader(path)
    for state in (False, True):
        code = (
            "import sys; from pathlib import Path; "
            "from splitserve.common.busy_flag import BusyFlag; "
            f"BusyFlag(Path(sys.argv[1])).set({state})"
        )
        subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=60)
        reader._next_open_at = 0.0
        assert reader.is_busy() is state


@pytest.fixture(autouse=True)
def _torch_pool_size_restored() -> Iterator[None]:
    """Steps resize torch's (process-wide) pool; later tests get the size they started with."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _threads_in_steps(step_threads: StepThreads, lender: BusyFlag, states: list[bool]) -> list[int]:
    """torch's pool size in each step, the lender busy or idle before it; on a thread of its
    own, as the engine's."""
    sizes: list[int] = []

    def steps() -> None:
        for busy in states:
            lender.set(busy)
            step_threads.before_step()
            sizes.append(torch.get_num_threads())

    thread = threading.Thread(target=steps)
    thread.start()
    thread.join()
    return sizes


def test_steps_take_the_borrowed_cores_only_while_their_owner_idles(tmp_path: Path) -> None:
    lender = BusyFlag(tmp_path / "prefill.busy")
    borrowed = BorrowedCores(frozenset({0}), owner=BusyFlagReader(tmp_path / "prefill.busy"))
    step_threads = StepThreads(own_threads=1, borrows=borrowed)
    assert _threads_in_steps(step_threads, lender, [False, True, True, False]) == [2, 1, 1, 2]
    assert (step_threads.steps, step_threads.borrowed_steps) == (4, 2)


def test_a_lending_engine_says_busy_from_its_first_step_until_it_idles(tmp_path: Path) -> None:
    path = tmp_path / "decode.busy"
    step_threads = StepThreads(own_threads=torch.get_num_threads(), lends=BusyFlag(path))
    reader = BusyFlagReader(path)
    step_threads.idle()
    assert not reader.is_busy()
    step_threads.before_step()
    assert reader.is_busy()
    step_threads.idle()
    assert not reader.is_busy()


class _Lender:
    """A lender's state as a borrower reads it (``LenderState``), set by the test."""

    busy = False

    def is_busy(self) -> bool:
        return self.busy


def _borrowing_with_step_times(
    own_s: float, borrowed_s: float, steps: int, lender: _Lender | None = None
) -> list[bool]:
    """Whether each of ``steps`` steps borrowed the lender's core, when own steps take
    ``own_s`` and borrowed ones ``borrowed_s`` against a prediction of 0.1 s (the lender
    idle unless one is given)."""
    lender = lender or _Lender()
    step_threads = StepThreads(own_threads=1, borrows=BorrowedCores(frozenset({0}), lender))
    taken = []
    for _ in range(steps):
        borrowed_before = step_threads.borrowed_steps
        step_threads.before_step()
        borrowed = step_threads.borrowed_steps > borrowed_before
        taken.append(borrowed)
        step_threads.after_step(borrowed_s if borrowed else own_s, 0.1)
    return taken


COMPARING = [i % 2 == 0 for i in range(2 * step_threads_module.MIN_SAMPLES)]
"""The first idle-lender steps: borrowed and own in turn, until each kind has its samples."""


def _is_trial(index: int) -> bool:
    return (index + 1) % step_threads_module.RETRY_EVERY == 0


def test_borrowing_continues_while_borrowed_steps_measure_faster() -> None:
    taken = _borrowing_with_step_times(own_s=0.12, borrowed_s=0.08, steps=120)
    expected = COMPARING + [not _is_trial(i) for i in range(len(COMPARING), 120)]
    assert taken == expected


@pytest.mark.parametrize("borrowed_s", [0.13, 0.097], ids=["slower", "only-3%-faster"])
def test_borrowing_is_declined_unless_borrowed_steps_measure_5_percent_faster(
    borrowed_s: float,
) -> None:
    """A borrowed core shared with other processes: steps there are no faster. Declined,
    with one step in ``RETRY_EVERY`` borrowing anyway, to follow the load."""
    taken = _borrowing_with_step_times(own_s=0.10, borrowed_s=borrowed_s, steps=120)
    assert taken == COMPARING + [_is_trial(i) for i in range(len(COMPARING), 120)]


def test_steps_while_the_lender_computes_compare_nothing() -> None:
    """Own steps taken while the lender is busy run beside its work: they are not the
    baseline a borrowed step is compared with."""
    busy = _Lender()
    busy.busy = True
    assert not any(_borrowing_with_step_times(0.05, 0.2, steps=40, lender=busy))
    step_threads = StepThreads(own_threads=1, borrows=BorrowedCores(frozenset({0}), busy))
    for _ in range(40):
        step_threads.before_step()
        step_threads.after_step(0.05, 0.1)
    assert step_threads.borrowing_pays() is None


def test_steps_the_model_could_not_predict_teach_nothing() -> None:
    step_threads = StepThreads(own_threads=1, borrows=BorrowedCores(frozenset({0}), _Lender()))
    for _ in range(40):
        step_threads.before_step()
        step_threads.after_step(0.1, 0.0)
    assert step_threads.borrowing_pays() is None


def _sizes_at_layers(step_threads: StepThreads, lender: _Lender, busy_at: list[bool]) -> list[int]:
    """torch's pool size at the start of one step and after each layer boundary, the lender
    busy or not at each (on a thread of its own, as the engine's)."""
    sizes: list[int] = []

    def step() -> None:
        lender.busy = busy_at[0]
        step_threads.before_step()
        sizes.append(torch.get_num_threads())
        for busy in busy_at[1:]:
            lender.busy = busy
            step_threads.between_layers()
            sizes.append(torch.get_num_threads())
        step_threads.after_step(0.05, 0.1)

    thread = threading.Thread(target=step)
    thread.start()
    thread.join()
    return sizes


def test_a_borrowing_step_gives_the_cores_back_at_the_next_layer_once_their_owner_is_busy() -> None:
    """A prefill step on both cores when the decode worker turns busy mid-step: the pool
    shrinks to the own threads at the next layer and stays there, and the step (part
    borrowed, part own) teaches neither kind."""
    lender = _Lender()
    step_threads = StepThreads(own_threads=1, borrows=BorrowedCores(frozenset({0}), lender))
    assert _sizes_at_layers(step_threads, lender, [False, False, True, True]) == [2, 2, 1, 1]
    assert (step_threads.borrowed_steps, step_threads.yielded_steps) == (1, 1)
    assert step_threads._samples == {False: 0, True: 0}


def test_a_step_begun_on_its_own_cores_takes_the_borrowed_ones_once_their_owner_idles() -> None:
    """A prefill step begun while the decode worker decodes: once it idles, the step takes
    its core at the next layer, at most once a step, and gives it back if it turns busy
    again; such steps teach neither kind."""
    lender = _Lender()
    step_threads = StepThreads(own_threads=1, borrows=BorrowedCores(frozenset({0}), lender))
    assert _sizes_at_layers(step_threads, lender, [True, True, False, False]) == [1, 1, 2, 2]
    assert _sizes_at_layers(step_threads, lender, [True, False, True, False]) == [1, 2, 1, 1]
    assert (step_threads.grown_steps, step_threads.yielded_steps) == (2, 1)
    assert step_threads.borrowed_steps == 0 and step_threads._samples == {False: 0, True: 0}


def test_a_step_does_not_grow_onto_cores_where_borrowing_measured_no_faster() -> None:
    lender = _Lender()
    step_threads = StepThreads(own_threads=1, borrows=BorrowedCores(frozenset({0}), lender))
    for _ in range(2 * step_threads_module.MIN_SAMPLES):  # borrowed steps 30% slower
        borrowed_before = step_threads.borrowed_steps
        step_threads.before_step()
        borrowed = step_threads.borrowed_steps > borrowed_before
        step_threads.after_step(0.13 if borrowed else 0.10, 0.1)
    assert step_threads.borrowing_pays() is False
    assert _sizes_at_layers(step_threads, lender, [True, False, False]) == [1, 1, 1]
    assert step_threads.grown_steps == 0
    declined = step_threads.declined_steps  # a declined step has nothing to give back
    assert _sizes_at_layers(step_threads, lender, [False, True]) == [1, 1]
    assert step_threads.declined_steps == declined + 1 and step_threads.yielded_steps == 0


def test_the_engine_calls_between_layers_in_prompt_steps_and_the_tokens_stay_the_same() -> None:
    """``EngineCore.step(between_layers=...)``: called before every layer but the first of a
    step with prompt rows; resizing torch's pool there leaves the greedy float32 tokens as
    they were."""
    calls: list[int] = []  # torch's pool size at each call
    calls_by_step: list[int] = []

    def run(between_layers: object) -> list[int]:
        config = EngineConfig(
            model=ModelConfig(dtype="float32"),
            cache=CacheConfig(num_blocks=64),
            runner=RunnerConfig(num_threads=2),
        )
        core = EngineCore(config, random_checkpoint(SHAPES["tiny"], torch.float32, seed=3))
        core.add_request("r", list(range(5, 70)), SamplingParams(max_tokens=6, temperature=0))
        tokens: list[int] = []
        while core.has_unfinished:
            for output in core.step(between_layers=between_layers):  # type: ignore[arg-type]
                tokens.extend(output.update.new_token_ids)
            calls_by_step.append(len(calls))
        return tokens

    def shrink() -> None:
        calls.append(torch.get_num_threads())
        torch.set_num_threads(1)

    plain = run(None)
    assert calls_by_step == [0] * 6  # no hook, no calls
    calls_by_step.clear()
    torch.set_num_threads(2)
    assert run(shrink) == plain and len(plain) == 6
    layers = SHAPES["tiny"].num_hidden_layers
    # before each layer but the first and before each MLP: the prompt step on 2 threads, then
    # the rest of it on 1
    assert calls_by_step[0] == 2 * layers - 1 and calls[0] == 2
    assert calls[1 : 2 * layers - 1] == [1] * (2 * layers - 2)


def _worker_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_worker_args(parser, env={})
    args = parser.parse_args(list(flags))
    args.threads = None
    return args


def test_borrowing_flags_must_come_together_and_exclude_own_cores() -> None:
    assert borrowed_cpus(_worker_args("--cpu-affinity=1")) == set()
    both = ("--cpu-affinity=1", "--borrow-cores=0-1", "--borrow-while-idle=/x")
    assert borrowed_cpus(_worker_args(*both)) == {0}
    for halves in (
        ("--cpu-affinity=1", "--borrow-cores=0"),
        ("--cpu-affinity=1", "--borrow-while-idle=/x"),
        ("--borrow-cores=0", "--borrow-while-idle=/x"),
    ):
        with pytest.raises(ValueError, match="--borrow-cores needs"):
            borrowed_cpus(_worker_args(*halves))
    with pytest.raises(ValueError, match="no core besides"):
        borrowed_cpus(
            _worker_args("--cpu-affinity=1", "--borrow-cores=1", "--borrow-while-idle=/x")
        )


def test_the_worker_flags_build_the_engines_step_threads(tmp_path: Path) -> None:
    assert step_threads_of(_worker_args("--cpu-affinity=0")) is None
    lender = step_threads_of(_worker_args(f"--busy-file={tmp_path / 'p.busy'}"))
    assert lender is not None and lender.lends is not None and lender.borrows is None
    busy_file = f"--borrow-while-idle={tmp_path / 'p.busy'}"
    args = _worker_args("--cpu-affinity=1", "--borrow-cores=0", busy_file)
    args.threads = 1  # as apply_cpu_affinity sets it from --cpu-affinity
    borrower = step_threads_of(args)
    assert borrower is not None and borrower.lends is None
    assert borrower.own_threads == 1 and borrower.borrows is not None
    assert borrower.borrows.cores == frozenset({0})


@pytest.mark.parametrize(
    "flags",
    [
        ("--borrow-cores=0", "--borrow-while-idle=/dev/shm/x.busy"),  # without --cpu-affinity
        ("--cpu-affinity=0", "--borrow-cores=4096", "--borrow-while-idle=/dev/shm/x.busy"),
        ("--busy-file=/nonexistent-dir/x.busy",),
    ],
    ids=["no-pinning", "a-core-it-lacks", "busy-file-it-cannot-create"],
)
def test_a_worker_refuses_lending_flags_it_cannot_use_with_a_usage_error(
    flags: tuple[str, ...],
) -> None:
    """Exit status 2 and a message, before any server starts or model loads."""
    done = subprocess.run(
        [sys.executable, "-m", "splitserve.decode.main", "--port=0", *flags],
        env={**os.environ, TOKEN_ENV: CREDENTIAL.token},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "cores:" in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def _lending(monkeypatch: pytest.MonkeyPatch, cpus: int, *flags: str) -> list[list[str]]:
    """Each worker's lending flags in ``up``'s command lines, on a machine of ``cpus``."""
    monkeypatch.setattr(up.os, "sched_getaffinity", lambda _pid: set(range(cpus)))
    args = up.build_parser().parse_args(list(flags))
    workers = up.worker_argvs(args, "127.0.0.1:50052", [], busy_dir="/dev/shm/b")
    lending = ("--busy-file", "--borrow-cores", "--borrow-while-idle")
    return [[flag for flag in argv if flag.startswith(lending)] for _, argv in workers]


def test_up_lets_decode_worker_i_borrow_prefill_worker_is_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _lending(monkeypatch, 2) == [[], []]  # off by default
    prefill, decode = _lending(monkeypatch, 2, "--core-lending=decode")
    assert prefill == ["--busy-file=/dev/shm/b/worker-0.busy"]
    assert decode == ["--borrow-cores=0", "--borrow-while-idle=/dev/shm/b/worker-0.busy"]
    prefill, decode = _lending(monkeypatch, 2, "--core-lending=both")
    assert prefill[0] == "--busy-file=/dev/shm/b/worker-0.busy"
    assert prefill[1:] == ["--borrow-cores=1", "--borrow-while-idle=/dev/shm/b/worker-1.busy"]
    assert decode[0] == "--busy-file=/dev/shm/b/worker-1.busy"
    assert decode[1:] == ["--borrow-cores=0", "--borrow-while-idle=/dev/shm/b/worker-0.busy"]
    # two prefill, three decode workers on 10 cores (2 each): two pairs; the third decode
    # worker keeps to its own cores
    flags = _lending(monkeypatch, 10, "--prefill=2", "--decode=3", "--core-lending=decode")
    assert flags[3] == ["--borrow-cores=2,3", "--borrow-while-idle=/dev/shm/b/worker-1.busy"]
    assert flags[4] == []


@pytest.mark.parametrize(
    ("cpus", "flags"),
    [
        (2, ("--core-lending=off",)),
        (2, ("--no-pin", "--core-lending=both")),
        (1, ("--core-lending=both",)),  # too few cores to pin: nobody owns a core to lend
        (2, ("--prefill=0", "--decode=0", "--dual=2", "--core-lending=both")),
    ],
)
def test_up_lends_no_cores_where_workers_are_not_pinned_in_pairs(
    monkeypatch: pytest.MonkeyPatch, cpus: int, flags: tuple[str, ...]
) -> None:
    assert all(not worker for worker in _lending(monkeypatch, cpus, *flags))


def _counter(metrics_url: str, name: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return family.samples[0].value
    raise AssertionError(f"no {name} at {metrics_url}")


@pytest.mark.slow  # its flags, guard and step threads are covered above without processes,
# and up's pairing of the workers too (about 30 s saved)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="lending needs a core per worker")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("lending", ["decode", "both"])
def test_up_workers_run_on_the_idle_partners_core_and_answer_the_same(
    default_checkpoint_fp32: LoadedCheckpoint, lending: str
) -> None:
    """Through real processes: ``up`` pins a prefill and a decode worker a core each; the
    decode worker's steps after the first token run on both cores (the prefill worker sits
    idle then); with ``both`` (``hybrid``, what ``auto`` runs for a worker pair) the prefill
    worker computes the prompt on both cores too (the decode worker idle), and with
    ``decode`` it borrows nothing; the greedy float32 tokens equal those of the in-process
    float32 engine (batch and thread invariant: the cluster without lending gives them
    too)."""
    prompt = "The three primary colours are"
    sampling = Sampling(max_tokens=24, temperature=0.0, ignore_eos=True)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    [expected] = make_llm(default_checkpoint_fp32).generate([prompt], params)
    lines: dict[str, str] = {}
    up_flags = ("--placement=remote", f"--core-lending={lending}")
    with cluster(1, 1, "--dtype=float32", ready_lines=lines, up_flags=up_flags) as address:
        with Client(address) as client:
            generation = client.generate(prompt, sampling=sampling)
        decode_metrics, prefill_metrics = lines["decode metrics"], lines["prefill metrics"]
        steps = _counter(decode_metrics, "splitserve_engine_steps")
        borrowed = _counter(decode_metrics, "splitserve_engine_steps_on_borrowed_cores")
        assert steps >= 23 and borrowed > 0, (steps, borrowed)
        prefill_borrowed = _counter(prefill_metrics, "splitserve_engine_steps_on_borrowed_cores")
        assert (prefill_borrowed > 0) is (lending == "both"), prefill_borrowed
    assert len(generation.token_ids) == 24
    assert tuple(generation.token_ids) == tuple(expected.token_ids)
