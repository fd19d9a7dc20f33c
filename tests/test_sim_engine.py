"""The simulated engine (``--engine sim``): its profile is the step-cost model fitted to real
steps with its error on held-out ones; a step lasts what the profile predicts and hooks each
layer; its tokens do not depend on the path a request took; grammars still bind; the
calibrator records both kinds of real steps; one process hosts several simulated workers of a
real ``splitserve up`` cluster. (A cluster of simulated workers serving through the gateway,
its KV pushed over UCX, is also ``tests/test_stream_stalls.py``'s.)"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from splitserve.common.errors import ModelLoadError
from splitserve.common.grammar import GrammarSpec
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.step_cost import StepCost, StepShape
from splitserve.engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    RunnerConfig,
    SpeculativeConfig,
)
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.random_checkpoint import SHAPES, random_checkpoint
from splitserve.engine.sim_calibrate import LoadPhase, record_steps
from splitserve.engine.sim_profile import (
    SimProfile,
    StepRecord,
    fit_step_cost,
    held_out_mape,
    load_profile,
    read_step_logs,
)
from splitserve.engine.sim_runner import sim_token
from tests.cluster import cluster, gateway_completions, routable_members, wait_until_idle

TRUE_COST = StepCost(
    decode_base_s=0.010,
    per_decode_seq_s=0.003,
    per_context_token_s=1e-6,
    prefill_base_s=0.002,
    per_prefill_token_s=0.0012,
    decode_steps=100,
    prefill_steps=100,
)
FAST_COST = StepCost(1e-4, 1e-5, 1e-9, 1e-4, 1e-6, 100, 100)
"""Step times short enough for the tests that only look at tokens."""


def _profile(cost: StepCost = FAST_COST) -> SimProfile:
    return SimProfile(cost, "test", "test cpu", 1, "bfloat16", 200, 0.05)


def _sim_core(
    tmp_path: Path, cost: StepCost = FAST_COST, speculative_tokens: int = 0
) -> EngineCore:
    path = tmp_path / f"profile-{random.random()}.json"
    path.write_text(_profile(cost).to_json())
    config = EngineConfig(
        model=ModelConfig(dtype="bfloat16"),
        cache=CacheConfig(num_blocks=256),
        runner=RunnerConfig(engine="sim", sim_profile=str(path)),
        speculative=SpeculativeConfig(num_tokens=speculative_tokens),
    )
    return EngineCore(config)


def _run(
    core: EngineCore,
    prompt: Sequence[int],
    params: SamplingParams,
    prior: Sequence[int] = (),
    request_id: str = "r",
) -> list[int]:
    core.add_request(request_id, prompt, params, prior)
    tokens = list(prior)
    while core.has_unfinished:
        for output in core.step():
            tokens.extend(output.update.new_token_ids)
    return tokens


def _records(rng: random.Random, count: int) -> list[StepRecord]:
    records = []
    for index in range(count):
        seqs = rng.randint(1, 32)
        shape = StepShape(seqs, rng.randint(16, 512) if index % 4 == 0 else 0, seqs * 300)
        records.append(StepRecord(shape, TRUE_COST.step_s(shape) * rng.uniform(0.97, 1.03)))
    return records


def test_a_profile_is_the_step_cost_fitted_to_real_steps_with_its_held_out_error() -> None:
    records = _records(random.Random(3), 400)
    cost = fit_step_cost(records)
    assert cost.per_prefill_token_s == pytest.approx(TRUE_COST.per_prefill_token_s, rel=0.05)
    assert cost.per_decode_seq_s == pytest.approx(TRUE_COST.per_decode_seq_s, rel=0.1)
    assert 0.0 < held_out_mape(records) < 0.03  # the noise is +-3%
    profile = _profile(cost)
    assert SimProfile.from_json(profile.to_json()) == profile
    with pytest.raises(ValueError, match="decode and prefill steps"):
        held_out_mape(records[:20])  # 5 prefill steps in all


def test_what_is_not_a_profile_is_refused_naming_the_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="missing.json"):
        load_profile(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ModelLoadError, match="bad.json is not a simulation profile"):
        load_profile(bad)
    unfitted = tmp_path / "unfitted.json"
    raw = json.loads(_profile().to_json())
    raw["step_cost"]["prefill_steps"] = 0
    unfitted.write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="fitted on decode and prefill steps"):
        load_profile(unfitted)


def test_the_shipped_profile_is_a_fitted_one() -> None:
    profile = load_profile("default")
    assert profile.step_cost.knows_decode and profile.step_cost.knows_prefill
    assert profile.steps >= 100 and 0.0 < profile.mape < 0.25
    assert profile.dtype == "bfloat16" and profile.threads == 1


def test_a_step_lasts_what_the_profile_predicts_and_hooks_every_layer_in_turn(
    tmp_path: Path,
) -> None:
    core = _sim_core(tmp_path, TRUE_COST)
    runner = core.runner
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    runner._sleep, runner._clock = sleep, lambda: now[0]  # type: ignore[union-attr]
    layers: list[tuple[int, float]] = []
    core.add_request("a", list(range(1000, 1100)), SamplingParams(max_tokens=4, temperature=0))
    core.step(lambda layer, completed: layers.append((layer, now[0])))  # the prompt's step
    predicted = TRUE_COST.step_s(core.last_step.shape)
    assert core.last_step.shape == StepShape(0, 100, 0)
    assert sum(slept) == pytest.approx(predicted)
    num_layers = core.model_config.num_hidden_layers
    assert [layer for layer, _ in layers] == list(range(num_layers))
    assert layers[-1][1] == pytest.approx(predicted)  # the last layer's KV at the step's end
    assert layers[0][1] == pytest.approx(predicted / num_layers)
    slept.clear()
    core.step()  # a decode step: one sleep, no hook
    assert len(slept) == 1
    assert slept[0] == pytest.approx(TRUE_COST.step_s(core.last_step.shape))
    assert core.last_step.shape.decode_seqs == 1


def test_a_requests_tokens_do_not_depend_on_its_path(tmp_path: Path) -> None:
    core = _sim_core(tmp_path)
    prompt = core.tokenizer.encode("The miller kept his books by the river")
    greedy = SamplingParams(max_tokens=24, temperature=0)
    tokens = _run(core, prompt, greedy, request_id="plain")
    assert len(tokens) == 24  # never an end-of-sequence token: it runs to max_tokens
    words = core.runner.words  # type: ignore[union-attr]
    assert set(tokens) <= set(words)
    assert tokens[0] == sim_token(words, prompt[-1], len(prompt))
    # its first 10 tokens computed as prompt, as a prefill worker then a decode worker would
    continued = _run(core, [*prompt, *tokens[:10]], dataclasses.replace(greedy, max_tokens=14))
    assert continued == tokens[10:]
    # resumed elsewhere after 7 streamed tokens
    resumed = _run(_sim_core(tmp_path), prompt, greedy, prior=tokens[:7])
    assert resumed == tokens
    # sampled with a seed and penalties: the simulation does not sample
    sampled = dataclasses.replace(greedy, temperature=0.9, seed=5, repetition_penalty=1.3)
    assert _run(core, prompt, sampled, request_id="sampled") == tokens
    # drafted and verified by prompt lookup: the prompt holds (a, t) with t the token the
    # engine emits after its last token a, so that pair's continuation is drafted
    a, filler = prompt[-1], prompt[:-1]
    length = 2 * len(filler) + 3
    looked_up = [*filler, a, sim_token(words, a, length), *filler, a]
    speculative = _sim_core(tmp_path, speculative_tokens=3)
    plain = _run(core, looked_up, greedy, request_id="lookup")
    assert _run(speculative, looked_up, greedy) == plain
    assert speculative.stats.num_draft_tokens > 0  # drafts were verified, not skipped


def test_a_grammar_binds_a_simulated_engine_and_logprobs_are_reported(tmp_path: Path) -> None:
    core = _sim_core(tmp_path)
    prompt = core.tokenizer.encode("Answer yes or no:")
    constrained = SamplingParams(
        max_tokens=16, temperature=0, grammar=GrammarSpec("regex", "(yes|no), (maybe|never)")
    )
    text = core.tokenizer.decode(_run(core, prompt, constrained, request_id="g"))
    assert re.fullmatch("(yes|no), (maybe|never)", text), text
    core.add_request("l", prompt, SamplingParams(max_tokens=2, temperature=0, logprobs=3))
    logprobs = [lp for _ in range(3) for out in core.step() for lp in out.logprobs]
    assert len(logprobs) == 2
    assert all(lp.logprob == 0.0 and lp.rank == 1 and len(lp.top) == 3 for lp in logprobs)
    assert all(lp.top[0] == (lp.token_id, 0.0) for lp in logprobs)
    # prompt logprobs: 0 where the prompt holds the simulation's own next token, else -30
    words = core.runner.words  # type: ignore[union-attr]
    echoing = [*prompt, sim_token(words, prompt[-1], len(prompt))]
    core.add_request("p", echoing, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))
    (out,) = [out for _ in range(3) for out in core.step() if out.update.request_id == "p"]
    assert [lp.token_id for lp in out.prompt_logprobs] == echoing[1:]
    assert out.prompt_logprobs[-1].logprob == 0.0 and out.prompt_logprobs[-1].rank == 1
    assert all(lp.logprob in (0.0, -30.0) and len(lp.top) == 2 for lp in out.prompt_logprobs)
    assert any(lp.logprob == -30.0 and lp.rank == 2 for lp in out.prompt_logprobs)


def test_a_serving_engine_logs_its_steps_for_a_profile_to_be_fitted_to(tmp_path: Path) -> None:
    config = EngineConfig(
        model=ModelConfig(dtype="float32"),
        cache=CacheConfig(num_blocks=128),
        runner=RunnerConfig(num_threads=1, record_steps=str(tmp_path / "steps")),
    )
    core = EngineCore(config, random_checkpoint(SHAPES["tiny"], torch.float32))
    _run(core, list(range(5, 45)), SamplingParams(max_tokens=5, temperature=0))
    (log,) = (tmp_path / "steps").glob("*.jsonl")
    header = json.loads(log.read_text().splitlines()[0])
    assert header["dtype"] == "float32" and header["threads"] == 1 and header["cpu"]
    records = read_step_logs([log])
    assert [r.shape for r in records] == [
        StepShape(0, 40, 0), *(StepShape(1, 0, 40 + i) for i in range(1, 5))
    ]  # fmt: skip
    assert records[-1].seconds == core.last_step.seconds
    log.write_text(log.read_text() + "[1, 2]\n")
    with pytest.raises(ModelLoadError, match=f"{log.name}:7 is not a step record"):
        read_step_logs([log])


def test_the_calibrator_records_prompt_and_decode_steps_of_a_real_engine() -> None:
    config = EngineConfig(
        model=ModelConfig(dtype="float32"),
        cache=CacheConfig(num_blocks=128),
        runner=RunnerConfig(num_threads=1),
    )
    core = EngineCore(config, random_checkpoint(SHAPES["tiny"], torch.float32))
    phases = (LoadPhase(24, 4, True), LoadPhase(30, 6, False), LoadPhase(16, 2, True))
    records = record_steps(core, phases, seed=1, max_prompt_tokens=96)
    assert sum(r.shape.prefill_tokens > 0 for r in records) >= 16
    assert sum(r.shape.prefill_tokens == 0 for r in records) >= 16
    assert all(r.seconds > 0 for r in records)
    cost = fit_step_cost(records)
    assert cost.knows_decode and cost.knows_prefill
    assert held_out_mape(records) >= 0.0
    assert not core.has_unfinished  # every phase ran to the end


@pytest.mark.slow  # 7 s; bench/bench_scale.py hosts every simulated worker this way
def test_one_process_hosts_several_simulated_workers_each_its_own_member(
    tmp_path: Path,
) -> None:
    """``up --workers-per-process 2``: 2 prefill + 4 decode workers in 3 processes, each
    worker its own port and membership record; requests spread over the hosted decode
    workers and get the in-process simulated engine's text."""
    offline = _sim_core(tmp_path)
    prompts = [f"Request number {i} asks about the river" for i in range(24)]
    expected = [
        offline.tokenizer.decode(
            _run(offline, offline.tokenizer.encode(p), SamplingParams(max_tokens=8), request_id=p)
        )
        for p in prompts
    ]
    lines: dict[str, str] = {}
    processes: list[subprocess.Popen[str]] = []
    flags = ("--workers-per-process=2",)
    with cluster(
        2, 4, "--engine=sim", "--num-blocks=128", ready_lines=lines, up_flags=flags,
        processes=processes,
    ) as coordinator:  # fmt: skip
        members = routable_members(coordinator)
        children = Path(f"/proc/{processes[0].pid}/task/{processes[0].pid}/children")
        hosting = [
            pid
            for pid in children.read_text().split()
            if b"--host-workers=2" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        ]
        texts = asyncio.run(gateway_completions(lines["splitserve gateway ready"], prompts, 8))
        loads = wait_until_idle(coordinator, 6)
    assert members == {
        "prefill-0-0", "prefill-0-1", "decode-1-0", "decode-1-1", "decode-2-0", "decode-2-1"
    }  # fmt: skip
    assert len(hosting) == 3
    assert texts == expected
    decoded = [loads[m].num_finished_requests - 1 for m in members if m.startswith("decode")]
    assert sum(decoded) == len(prompts)  # each worker's one warm-up request left out
    assert sum(count > 0 for count in decoded) >= 2
