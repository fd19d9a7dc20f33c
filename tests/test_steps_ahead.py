"""Decode steps launched ahead (``EngineCore.steps_ahead``): the step after a replayed decode
step is planned (``Scheduler.schedule_ahead``) and launched with the replayed step's tokens
fed on the device (``ModelRunner.launch_decode``) before the host reads them.

The engine tests run the Triton backend under the interpreter with ``record_step`` standing in
for the CUDA graphs (as ``test_decode_graphs.py``); there everything runs before a launch
returns, so what they check is the bookkeeping: every request's float32 greedy tokens equal the
engine's that reads each step before the next (arrivals, data-dependent stops, lengths, aborts,
a seeded sampled request and one the device cannot decide alone included), steps did go ahead,
and no block is left held. The scheduler tests check the block quarantine: a request that ends
while a launched step may still write its KV gives its blocks back only once that step settled.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.decode_graphs import record_step
from splitserve.engine.engine_core import EngineCore
from tests.engine_driver import Arrivals, drive, greedy, mixed_arrivals
from tests.factories import make_request, make_scheduler
from tests.host_reads import HostReads, guarded
from tests.test_decode_graphs import _llm, _prompts


def _engine(steps_ahead: bool) -> EngineCore:
    engine = _llm().engine
    engine.steps_ahead = steps_ahead
    engine.runner.capture_decode_graphs(8, engine.max_model_len, record_step)
    return engine


@pytest.mark.slow  # three engines over a mixed workload (15 s); the rules are tested below
def test_steps_ahead_give_every_request_the_tokens_of_steps_read_one_by_one() -> None:
    prompts = _prompts(6)
    # A first run without stops finds a token request "c" makes mid-way: as its stop token
    # it ends "c" where only the device's choice says so (the step after is already out).
    probe, _ = drive(_engine(False), {0: [("c", prompts[2], greedy(10))]}, {})
    stop_token = probe["c"][4]
    arrivals, aborts = mixed_arrivals(prompts, stop_token)
    expected = drive(_engine(False), arrivals, aborts)
    engine = _engine(True)
    got = drive(engine, arrivals, aborts)
    assert got == expected
    tokens, finish = got
    assert finish["c"] == "stop" and tokens["c"][-1] == stop_token
    assert tokens["m"][:4] == tokens["c"][:4] and tokens["m"][4] != stop_token  # masked there
    assert "a" not in finish and 0 < len(tokens["a"]) < 14  # aborted mid-way, no update
    assert finish["b"] == "length" and len(tokens["b"]) == 5
    assert finish["g"] == "length" and len(tokens["g"]) == 12  # sampled, seeded
    assert finish["h"] == "length" and len(tokens["h"]) == 11  # and cut off by top-k/top-p
    assert engine.steps_launched_ahead >= 6, engine.steps_launched_ahead
    assert not engine.has_unfinished


@pytest.mark.slow  # two engines of a disaggregated pair (11 s)
def test_requests_joining_from_remote_prefills_ride_the_steps_ahead() -> None:
    """A decode engine of a disaggregated pair: requests arrive prefilled elsewhere (their KV
    pushed into reserved blocks, their first token sampled there) while steps run ahead; the
    step ahead takes them with their own first token after the fed rows. Every request's
    tokens equal those of a decode engine reading each step first."""
    prompts = _prompts(6)
    joins: Arrivals = {
        0: [("a", prompts[0], greedy(12)), ("b", prompts[1], greedy(4))],
        3: [("c", prompts[2], greedy(8))],
        5: [("d", prompts[4], greedy(6)), ("e", prompts[5], greedy(7))],
    }
    expected = drive(_engine(False), {}, {}, joins, prefill=_llm().engine)
    engine = _engine(True)
    assert drive(engine, {}, {}, joins, prefill=_llm().engine) == expected
    tokens, finish = expected
    assert {request_id: len(t) for request_id, t in tokens.items()} == {
        "a": 12,
        "b": 4,
        "c": 8,
        "d": 6,
        "e": 7,
    }
    assert set(finish.values()) == {"length"}
    # No step stopped for the joins: every decode step after the first went ahead.
    graphs = engine.runner.decode_graphs
    assert engine.steps_launched_ahead == graphs.replays.total() - 1, graphs.replays


def test_each_step_says_whether_it_ran_ahead() -> None:
    """``last_step.ran_ahead`` (the worker's ``splitserve_engine_steps_ahead_total``): the
    prefill and the first decode step were read in turn; the decode steps after went ahead."""
    engine = _engine(True)
    for request_id, prompt in zip("ab", _prompts(2), strict=True):
        engine.add_request(request_id, prompt, greedy(6))
    ran_ahead = []
    while engine.has_unfinished:
        engine.step()
        ran_ahead.append(engine.last_step.ran_ahead)
    assert ran_ahead == [False, False, True, True, True, True], ran_ahead


def test_no_step_goes_ahead_of_one_the_host_must_read() -> None:
    """A request with logprobs (or any the device cannot decide alone) keeps every step
    read before the next; the tokens are the same either way."""
    prompts = _prompts(2)
    arrivals: Arrivals = {
        0: [("a", prompts[0], greedy(6)), ("b", prompts[1], greedy(6, logprobs=0))]
    }
    engine = _engine(True)
    assert drive(engine, arrivals, {}) == drive(_engine(False), arrivals, {})
    assert engine.steps_launched_ahead == 0


def test_a_launched_step_reads_nothing_on_the_host() -> None:
    """Every ``launch_decode`` (the buffers' fill, the feed of the step before's tokens, the
    sampler's choice for greedy, seeded, top-k, top-p and min-p rows, ``min_tokens``' mask of
    EOS and the stop tokens, the tokens' copy) runs
    under a guard that fails on any read of a tensor's value on the host (``tests/
    host_reads.py``), the replay aside: on a GPU such a read would wait for the step before
    and the step ahead would gain nothing (``test_gpu_engine.py`` checks the same with CUDA's
    sync debug mode)."""
    guard = HostReads()
    engine = _llm().engine
    engine.runner.capture_decode_graphs(
        8, engine.max_model_len, lambda run: record_step(guard.outside(run))
    )
    launched = []  # each launch_decode's step, None where it launched nothing
    launch = guarded(guard, engine.runner.launch_decode)
    engine.runner.launch_decode = lambda *args: launched.append(launch(*args)) or launched[-1]
    prompts = _prompts(6)
    sampled = [
        SamplingParams(max_tokens=8, temperature=0.8, seed=5, min_tokens=8, stop_token_ids=(9,)),
        SamplingParams(max_tokens=8, temperature=3.0, top_k=450, top_p=0.99, seed=7),
        SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, min_p=0.02),
        SamplingParams(max_tokens=8, temperature=0.7, top_k=20),
    ]
    arrivals: Arrivals = {
        0: [("greedy", prompts[0], greedy(8)), ("min", prompts[5], greedy(8, min_tokens=8))]
    }
    arrivals[0] += [(f"sampled-{i}", prompts[1 + i], p) for i, p in enumerate(sampled)]
    tokens, _ = drive(engine, arrivals, {})
    assert all(len(tokens[request_id]) == 8 for request_id, *_ in arrivals[0]), tokens
    assert sum(step is not None for step in launched) == 7 and engine.steps_launched_ahead == 6


def test_min_tokens_rows_go_ahead_with_their_stops_masked_as_steps_read_one_by_one() -> None:
    """``min_tokens`` masks EOS and the stop tokens by a count the host knows ahead (a fed
    row has one more output than the host has read: ``SamplingRow.pending_outputs``), so its
    rows go ahead. Each request's stop token is one the model picks on its own before
    ``min_tokens``: the mask changes what it generates, and a mask off by one step would
    change it again. Tokens equal to an engine reading each step first; steps went ahead."""
    prompts = _prompts(3)
    seeded = SamplingParams(max_tokens=10, temperature=0.8, seed=3)
    probe, _ = drive(
        _engine(False), {0: [("p", prompts[0], greedy(10)), ("s", prompts[1], seeded)]}, {}
    )
    arrivals: Arrivals = {
        0: [
            # its own 4th token (index 3) as a stop, masked until 4 outputs: first allowed
            # exactly where the model first picked it, at the mask's boundary
            ("edge", prompts[0], greedy(10, min_tokens=3, stop_token_ids=(probe["p"][3],))),
            ("late", prompts[0], greedy(10, min_tokens=6, stop_token_ids=(probe["p"][2],))),
            (
                "seeded",
                prompts[1],
                dataclasses.replace(seeded, min_tokens=5, stop_token_ids=(probe["s"][1],)),
            ),
            ("plain", prompts[2], greedy(8)),
        ]
    }
    expected = drive(_engine(False), arrivals, {})
    engine = _engine(True)
    assert drive(engine, arrivals, {}) == expected
    tokens, finish = expected
    assert tokens["edge"] == probe["p"][:4] and finish["edge"] == "stop"  # stopped at the edge
    assert tokens["late"][:2] == probe["p"][:2] and tokens["late"][2] != probe["p"][2]
    assert engine.steps_launched_ahead >= 4, engine.steps_launched_ahead
    assert not engine.has_unfinished


def test_an_engine_without_graphs_never_goes_ahead() -> None:
    engine = _llm().engine
    assert engine.steps_ahead and engine.runner.decode_graphs is None
    tokens, _ = drive(engine, {0: [("a", _prompts(1)[0], greedy(5))]}, {})
    assert len(tokens["a"]) == 5 and engine.steps_launched_ahead == 0


# --------------------------------------------------------------------------- the scheduler


def _running(scheduler, *requests):
    """The requests admitted, prefilled (token 7 sampled) and due a decode step."""
    for request in requests:
        scheduler.add_request(request)
    step = scheduler.schedule()
    scheduler.update(step, {chunk.request_id: 7 for chunk in step.chunks})
    return scheduler.schedule()


def test_schedule_ahead_plans_the_next_decode_one_position_on() -> None:
    scheduler = make_scheduler(block_size=4)
    step = _running(scheduler, make_request("a", prompt_len=3, max_tokens=5))
    [chunk] = step.chunks
    assert (chunk.start_position, list(chunk.token_ids)) == (3, [7])
    free = scheduler.kv_cache.num_free_blocks
    ahead = scheduler.schedule_ahead(step, placeholder=0)
    assert ahead is not None
    [next_chunk] = ahead.chunks
    assert (next_chunk.start_position, next_chunk.token_ids) == (4, (0,))
    assert next_chunk.context_length == 5 and next_chunk.samples
    assert len(next_chunk.block_table) == 2  # position 4 opens the second block of 4
    assert scheduler.kv_cache.num_free_blocks == free - 1
    # Applying both in order leaves the request where two read steps would have.
    scheduler.update(step, {"a": 8})
    scheduler.update(ahead, {"a": 9})
    request = scheduler.requests["a"]
    assert request.output_token_ids == [7, 8, 9] and request.num_computed_tokens == 5


@pytest.mark.parametrize(
    ("params", "why"),
    [
        ({"max_tokens": 2}, "ends by length with the launched step's token: no one is left"),
        ({"logprobs": 1}, "its logprobs are read on the host"),
        ({"repetition_penalty": 1.2}, "a penalty reads its outputs"),
        ({"bad_words": ("x",)}, "bad words read its outputs"),
    ],
)
def test_schedule_ahead_refuses_what_the_device_cannot_decide(params, why) -> None:
    scheduler = make_scheduler()
    max_tokens = params.pop("max_tokens", 8)
    step = _running(scheduler, make_request("a", max_tokens=max_tokens, **params))
    assert scheduler.schedule_ahead(step) is None, why


def test_a_request_ending_by_length_is_left_out_of_the_step_ahead() -> None:
    scheduler = make_scheduler()
    step = _running(scheduler, make_request("a", max_tokens=2), make_request("b", first_token=40))
    ahead = scheduler.schedule_ahead(step)
    assert ahead is not None and [chunk.request_id for chunk in ahead.chunks] == ["b"]


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.7, "min_p": 0.05},
        {"temperature": 0.0, "top_p": 0.9},
        {"temperature": 0.7, "top_p": 0.9},  # its nucleus found on the device
        {"temperature": 0.7, "top_k": 40},
        {"temperature": 1.0, "top_k": 4000, "top_p": 0.95},
    ],
)
def test_sampled_requests_go_ahead_with_any_cut_off(sampling) -> None:
    scheduler = make_scheduler()
    step = _running(scheduler, make_request("a", max_tokens=8), make_request("b", seed=3))
    request = scheduler.requests["b"]
    request.params = dataclasses.replace(request.params, **sampling)
    ahead = scheduler.schedule_ahead(step)
    assert ahead is not None and len(ahead.chunks) == 2


def test_schedule_ahead_waits_for_admissions_and_joined_requests() -> None:
    scheduler = make_scheduler()
    step = _running(scheduler, make_request("a", max_tokens=8))
    scheduler.add_request(make_request("b", max_tokens=8))  # waits for a prefill
    assert scheduler.schedule_ahead(step) is None


def test_a_request_ended_under_a_launched_step_frees_its_blocks_when_it_settles() -> None:
    scheduler = make_scheduler(block_size=4)
    kv = scheduler.kv_cache
    step = _running(scheduler, make_request("a", max_tokens=8), make_request("b", max_tokens=8))
    ahead = scheduler.schedule_ahead(step)
    assert ahead is not None
    scheduler.launched(1, step)
    scheduler.launched(2, ahead)
    scheduler.update(step, {"a": 8, "b": 9})
    scheduler.settle(1)
    held = len(kv.block_table("a"))
    free = kv.num_free_blocks
    scheduler.abort_request("a")  # step 2 may still write a's next slot
    assert kv.block_table("a") == [] and kv.num_free_blocks == free
    scheduler.add_request(make_request("a", max_tokens=2))  # the id is free again at once
    scheduler.settle(2)
    assert kv.num_free_blocks == free + held
    scheduler.abort_request("b")  # nothing in flight: freed at once
    assert kv.num_free_blocks > free + held
    scheduler.abort_request("a")
    assert kv.num_free_blocks == kv.num_blocks


def test_a_request_preempted_under_a_launched_step_frees_its_blocks_when_it_settles() -> None:
    """The engine plans with ``schedule`` only once no step is in flight, but the scheduler
    does not rely on it: a request preempted while a launched step may still write its KV
    keeps its blocks out of the pool until that step settles, as an ended one does."""
    scheduler = make_scheduler(num_blocks=3, block_size=4, enable_prefix_caching=False)
    kv = scheduler.kv_cache
    for request_id, first in (("a", 10), ("b", 40)):
        scheduler.add_request(make_request(request_id, prompt_len=4, first_token=first))
    prefill = scheduler.schedule()  # a block each, one left
    scheduler.launched(1, prefill)  # still writing both requests' KV
    scheduler.update(prefill, {"a": 7, "b": 7})
    decode = scheduler.schedule()  # both need a second block: "a" takes the last, "b" yields
    assert [chunk.request_id for chunk in decode.chunks] == ["a"]
    assert kv.block_table("b") == [] and kv.num_free_blocks == 0  # b's block waits
    scheduler.settle(1)
    assert kv.num_free_blocks == 1


def test_launched_token_ids_reach_the_host_in_row_order() -> None:
    """``LaunchedDecode.wait`` off CUDA: the rows' tokens as launched."""
    from splitserve.engine.launched_step import LaunchedDecode

    step = _running(make_scheduler(), make_request("a"), make_request("b", first_token=40))
    ids = torch.tensor([5, 6])
    launched = LaunchedDecode(1, step.chunks, ids, ids.clone(), None)
    assert launched.wait() == [5, 6] and launched.row_of == {"a": 0, "b": 1}
