"""``splitserve up --layout``: the probe's result, the queueing model that picks a layout from
it (``launch/layout.py``), the probe run as ``up`` runs it (a real child process, cached per
configuration), and how ``up`` turns the choice into workers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitserve.common.layout_probe import BATCH, PhaseTimes, ProbeResult, probe_thread_counts
from splitserve.engine.random_checkpoint import save_random_model
from splitserve.launch import layout, up
from splitserve.launch.layout import (
    AGGREGATED_MARGIN,
    HEADROOM,
    Workload,
    capacity,
    choose,
    load_or_probe,
    predict,
    probe_cache_path,
    workload_of,
)

CHAT = Workload()


def _phase(threads: int, prefill_s: float, one_s: float, batch_s: float) -> PhaseTimes:
    return PhaseTimes(
        threads=threads, prefill_s=prefill_s, decode_one_s=one_s, decode_batch_s=batch_s
    )


def _probe(half: PhaseTimes, whole: PhaseTimes) -> ProbeResult:
    return ProbeResult(
        cpu="test", cores=2, dtype="float32", prompt_tokens=320, phases=(half, whole), probe_s=1
    )


def test_the_probe_times_a_split_workers_cores_and_then_all() -> None:
    assert probe_thread_counts(1) == (1,)
    assert probe_thread_counts(2) == (1, 2)
    assert probe_thread_counts(3) == (1, 3)
    assert probe_thread_counts(16) == (8, 16)
    with pytest.raises(ValueError):
        probe_thread_counts(0)


def test_a_probe_result_round_trips_and_a_foreign_file_is_refused() -> None:
    probe = _probe(_phase(1, 1.0, 0.03, 0.06), _phase(2, 0.5, 0.02, 0.04))
    assert ProbeResult.from_json(json.loads(json.dumps(probe.to_json()))) == probe
    for junk in ([], {"cpu": "x"}, {**probe.to_json(), "phases": [{"threads": 1}]}):
        with pytest.raises(ValueError):
            ProbeResult.from_json(junk)
    with pytest.raises(ValueError):  # thread counts out of order
        _probe(_phase(2, 0.5, 0.02, 0.04), _phase(1, 1.0, 0.03, 0.06))
    with pytest.raises(ValueError):
        _phase(1, 0.0, 0.03, 0.06)


def test_a_decode_step_grows_on_the_line_through_the_two_measured_batches() -> None:
    phase = _phase(1, 1.0, 0.030, 0.030 + 0.002 * (BATCH - 1))
    assert phase.decode_step_s(1) == pytest.approx(0.030)
    assert phase.decode_step_s(BATCH) == pytest.approx(phase.decode_batch_s)
    assert phase.decode_step_s(20) == pytest.approx(0.030 + 0.002 * 19)
    assert _phase(1, 1.0, 0.05, 0.04).decode_per_request_s == 0.0  # never cheaper with more


def test_where_all_cores_do_far_better_than_half_the_aggregated_layout_is_chosen() -> None:
    """All cores three times as fast as half of them (a prompt in 0.4 against 1.2 s): the
    aggregated layout is predicted 4x the worker pair's rate, past ``AGGREGATED_MARGIN``."""
    probe = _probe(_phase(1, 1.2, 0.030, 0.070), _phase(2, 0.4, 0.012, 0.025))
    choice = choose(probe, CHAT)
    rates = dict(choice.capacities)
    assert choice.layout == "aggregated", choice
    assert rates["aggregated"] > rates["hybrid"] > 0
    assert "aggregated" in choice.summary and "hybrid" in choice.summary


def test_where_all_cores_only_halve_both_phases_the_worker_pair_is_kept() -> None:
    """Both phases twice as fast on all cores: aggregated predicted 1.8x the pair's rate,
    short of ``AGGREGATED_MARGIN`` (served, it never reached split's goodput; see its
    docstring). The pair runs as ``hybrid``, lending each other their cores."""
    probe = _probe(_phase(1, 1.0, 0.030, 0.060), _phase(2, 0.5, 0.015, 0.030))
    choice = choose(probe, CHAT)
    rates = dict(choice.capacities)
    assert rates["hybrid"] < rates["aggregated"] < AGGREGATED_MARGIN * rates["hybrid"]
    assert choice.layout == "hybrid", choice


def test_where_all_cores_are_no_faster_the_worker_pair_is_chosen() -> None:
    """What the probe found on the 2-core Cascade Lake Xeon, beside its neighbour: two threads
    no faster than one, so prompts chunked into the decode batch only cost ITL."""
    phase = _phase(1, 0.87, 0.0266, 0.0566)
    probe = _probe(phase, _phase(2, 0.81, 0.0324, 0.0615))
    choice = choose(probe, CHAT)
    assert choice.layout == "hybrid", choice
    assert dict(choice.capacities)["hybrid"] > dict(choice.capacities)["aggregated"]


@pytest.mark.parametrize(
    "one_thread, two_threads",
    [
        ((0.7835, 0.0210, 0.0473), (0.4780, 0.0175, 0.0349)),
        ((1.101, 0.0177, 0.0558), (0.796, 0.0138, 0.0351)),
    ],
    ids=["python-loop", "c-loop"],
)
def test_aggregated_predicted_only_a_little_ahead_keeps_the_worker_pair(
    one_thread, two_threads
) -> None:
    """Probes of the Cascade Lake Xeon (2026-11-27): aggregated predicted ahead of split, where
    served it reached 0.75-0.78x of split's goodput (the Python layer loop), and 0.13x at 0.6
    req/s once decode steps ran their layer loop in C (predicted 1.6x)."""
    probe = _probe(_phase(1, *one_thread), _phase(2, *two_threads))
    choice = choose(probe, CHAT)
    rates = dict(choice.capacities)
    assert rates["hybrid"] < rates["aggregated"] < AGGREGATED_MARGIN * rates["hybrid"]
    assert choice.layout == "hybrid", choice


@pytest.mark.parametrize("layout", ["split", "hybrid", "aggregated"])
def test_capacity_is_the_edge_of_the_targets(layout: str) -> None:
    probe = _probe(_phase(1, 1.0, 0.030, 0.060), _phase(2, 0.6, 0.020, 0.045))
    rate = capacity(probe, CHAT, layout)
    assert rate > 0
    assert predict(probe, CHAT, layout, rate).within(CHAT)
    beyond = predict(probe, CHAT, layout, rate * 1.01)
    assert not beyond.within(CHAT)
    assert beyond.ttft_s > HEADROOM * CHAT.ttft_s or beyond.itl_s > HEADROOM * CHAT.itl_s


def test_a_layout_that_cannot_keep_up_predicts_no_finite_latency() -> None:
    probe = _probe(_phase(1, 2.0, 0.030, 0.060), _phase(2, 1.0, 0.020, 0.040))
    assert predict(probe, CHAT, "split", 0.5).ttft_s == float("inf")  # prompts: 1 s of 1 s
    assert predict(probe, CHAT, "aggregated", 1.0).itl_s == float("inf")


def test_where_no_layout_meets_the_targets_the_faster_at_a_trickle_is_chosen() -> None:
    probe = _probe(_phase(1, 4.0, 0.200, 0.400), _phase(2, 2.0, 0.100, 0.200))
    choice = choose(probe, CHAT)
    assert dict(choice.capacities) == {"hybrid": 0.0, "aggregated": 0.0}
    assert choice.layout == "aggregated"


def test_the_workload_flag_reads_four_numbers() -> None:
    assert workload_of("512,128,1500,40") == Workload(512, 128, 1.5, 0.04)
    for bad in ("320,96", "320,96,2000,x", "0,96,2000,50"):
        with pytest.raises(ValueError):
            workload_of(bad)


def _up_args(*flags: str) -> tuple[up.argparse.Namespace, bool]:
    return up.build_parser().parse_args(list(flags)), up.roles_given(list(flags))


def test_named_layouts_become_workers_and_explicit_counts_win(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_probe(*_args: object, **_kwargs: object) -> object:
        raise AssertionError("no probe for a named or explicit layout")

    monkeypatch.setattr(up, "load_or_probe", no_probe)
    for flags, expected in (
        (("--layout=split",), (1, 1, 0, "off")),
        (("--layout=aggregated",), (0, 0, 1, "off")),
        (("--layout=hybrid",), (1, 1, 0, "both")),
        (("--layout=hybrid", "--core-lending=decode"), (1, 1, 0, "decode")),
        (("--layout=split", "--core-lending=both"), (1, 1, 0, "both")),
        (("--dual=1", "--prefill=0", "--decode=0", "--core-lending=both"), (0, 0, 1, "both")),
        (("--prefill=2", "--decode=1"), (2, 1, 0, "off")),
        (("--dual=2",), (1, 1, 2, "off")),  # --dual alone keeps one of each beside it
        (("--layout=aggregated", "--decode=2"), (1, 2, 0, "off")),
    ):
        args, roles = _up_args(*flags)
        up.apply_layout(args, [], roles)
        assert (args.prefill, args.decode, args.dual, args.core_lending) == expected, flags
    args, roles = _up_args("--layout=aggregated")
    up.apply_layout(args, [], roles)
    assert up.layout_summary(args).startswith("layout aggregated (--layout aggregated), ")


def test_auto_runs_the_worker_pair_lending_both_ways_unless_lending_is_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A probe where all cores are no faster: ``auto`` runs the pair as ``hybrid``, each
    worker borrowing the other's cores while it idles, and says so; a ``--core-lending``
    given wins over the layout's."""
    probe = _probe(_phase(1, 0.87, 0.0266, 0.0566), _phase(2, 0.81, 0.0324, 0.0615))
    monkeypatch.setattr(up, "load_or_probe", lambda *_a, **_k: (probe, True))
    monkeypatch.setattr(up.os, "sched_getaffinity", lambda _pid: {0, 1})
    args, roles = _up_args()
    up.apply_layout(args, [], roles)
    assert args.layout_choice.layout == "hybrid"
    assert (args.prefill, args.decode, args.dual, args.core_lending) == (1, 1, 0, "both")
    assert "layout hybrid: " in capsys.readouterr().out
    assert "decode and prefill workers borrow" in up.layout_summary(args)
    args, roles = _up_args("--core-lending=off")
    up.apply_layout(args, [], roles)
    assert (args.layout_choice.layout, args.core_lending) == ("hybrid", "off")
    assert "borrow" not in up.layout_summary(args)


def test_auto_runs_simulated_workers_split_without_probing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(up, "load_or_probe", lambda *_a, **_k: pytest.fail("probed"))
    for worker_args in (["--engine", "sim"], ["--engine=sim"], ["--device=cuda"]):
        args, roles = _up_args()
        up.apply_layout(args, worker_args, roles)
        assert (args.prefill, args.decode, args.dual) == (1, 1, 0)
        assert args.layout_choice.layout == "split" and "auto" in args.layout_choice.reason


def test_auto_runs_split_with_a_warning_where_the_probe_fails(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(up.os, "sched_getaffinity", lambda _pid: {0, 1})
    args, roles = _up_args()
    up.apply_layout(args, ["--model", str(tmp_path / "no-such-model.gguf")], roles)
    assert args.layout_choice.layout == "split"
    assert (args.prefill, args.decode, args.dual) == (1, 1, 0)
    assert "the layout probe failed" in capsys.readouterr().err


@pytest.mark.slow  # two real probes; the probe's timing and its cache file are checked above
@pytest.mark.timeout(300)
def test_the_probe_runs_once_per_configuration_and_is_read_from_its_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The real probe in a child process, on a small random model: its result is cached under
    a key of the flags; the same flags read it back, other flags probe anew, and a damaged
    cache file is measured again rather than trusted."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = save_random_model("tiny", tmp_path / "tiny")
    flags = ["--model", str(model), "--dtype", "float32"]
    workload = Workload(prompt_tokens=48, output_tokens=16)
    said: list[str] = []
    probe, cached = load_or_probe(flags, workload, said.append)
    assert not cached and len(said) == 1 and "measuring" in said[0]
    assert probe.dtype == "float32" and probe.prompt_tokens == 48
    assert [phase.threads for phase in probe.phases] == list(probe_thread_counts(probe.cores))
    again, cached = load_or_probe(flags, workload, said.append)
    assert cached and again == probe and len(said) == 1
    path = probe_cache_path(flags, workload)
    assert path.is_relative_to(tmp_path / "cache")
    assert probe_cache_path([*flags, "--max-num-batched-tokens=256"], workload) != path
    assert probe_cache_path(flags, Workload(prompt_tokens=64)) != path
    with monkeypatch.context() as patch:  # another version of the engine or its kernels
        patch.setattr(layout, "code_identity", lambda: "another checkout")
        assert probe_cache_path(flags, workload) != path
    path.write_text("{", encoding="utf-8")
    _, cached = load_or_probe(flags, workload, said.append)
    assert not cached and len(said) == 2
