"""Drives an ``EngineCore`` step by step with requests arriving and aborted at given steps,
collecting each request's tokens: how the steps-ahead tests compare an engine that launches
decode steps ahead with one that reads every step first (``tests/test_steps_ahead.py`` on the
CPU, ``tests/test_gpu_engine.py`` on CUDA). Imports no Triton (the GPU tests must not load
the kernels in interpreter mode)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence

from splitserve.common.blocks import blocks_for_tokens
from splitserve.common.request_update import StepOutput
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.engine_core import CompletedPrompt, EngineCore

Arrivals = dict[int, list[tuple[str, list[int], SamplingParams]]]
"""Requests (id, prompt, params) added before the ``step`` call of each index."""
MAX_CALLS = 200


def greedy(max_tokens: int, **extra: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra)  # type: ignore[arg-type]


def join_remote(
    decode: EngineCore,
    prefill: EngineCore,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
) -> StepOutput:
    """A remote prefill as the workers do it, in one process: ``decode`` reserves blocks,
    ``prefill`` computes the prompt and pushes each layer's KV into them as it is written,
    then ``decode`` takes the request with the first token ``prefill`` sampled."""
    table = decode.reserve_remote_prefill(request_id, prompt, params)
    blocks = blocks_for_tokens(len(prompt), decode.kv_cache.block_size)

    def push_layer(layer: int, completed: Sequence[CompletedPrompt]) -> None:
        for done in completed:
            kv = prefill.runner.read_kv_blocks(layer, done.block_table[:blocks])
            decode.runner.write_kv_blocks(layer, table[:blocks], kv)

    prefill.add_request(request_id, prompt, dataclasses.replace(params, max_tokens=1))
    first: int | None = None
    while prefill.has_unfinished:
        for output in prefill.step(on_layer_kv_written=push_layer):
            first = output.update.new_token_ids[0]
    assert first is not None
    return decode.complete_remote_prefill(request_id, first)


def drive(
    engine: EngineCore,
    arrivals: Arrivals,
    aborts: dict[int, list[str]],
    joins: Arrivals | None = None,
    prefill: EngineCore | None = None,
) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Each request's tokens and finish reason (aborted ones have none), stepping until every
    arrival came and nothing is left; then every KV block must be back in the pool.
    ``joins``: requests prefilled on ``prefill`` and joining ``engine`` before the call of
    their index (``join_remote``)."""
    joins = joins or {}
    tokens: dict[str, list[int]] = defaultdict(list)
    finish: dict[str, str] = {}
    call = 0
    while call <= max([*arrivals, *joins]) or engine.has_unfinished:
        for request_id, prompt, params in arrivals.get(call, []):
            engine.add_request(request_id, prompt, params)
        for request_id, prompt, params in joins.get(call, []):
            assert prefill is not None
            first = join_remote(engine, prefill, request_id, prompt, params)
            tokens[request_id].extend(first.update.new_token_ids)
        for request_id in aborts.get(call, []):
            engine.abort_request(request_id)
        for output in engine.step():
            tokens[output.update.request_id].extend(output.update.new_token_ids)
            if output.update.finish_reason is not None:
                finish[output.update.request_id] = output.update.finish_reason.value
        call += 1
        assert call < MAX_CALLS, "the engine did not drain"
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    return dict(tokens), finish


def mixed_arrivals(
    prompts: list[list[int]], stop_token: int
) -> tuple[Arrivals, dict[int, list[str]]]:
    """Nine requests over 14 steps: lengths ending at different steps, "c" ending on
    ``stop_token`` (a token it makes mid-way: only the device's choice says where), "m" on
    the same prompt with that stop masked by ``min_tokens`` past where "c" makes it, "g"
    sampled at temperature 0.8 with a seed (its draws from its own generator, in the same
    order either way), "h" sampled with a seed under a top-k and a top-p cut-off (its nucleus
    found on the device when launched ahead), "d" and "f" arriving while steps run ahead, "e"
    asking logprobs (its steps read on the host), "a" aborted at step 9."""
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=5)
    # Hot enough that its nucleus (about 360-410 of 512 tokens) lies beyond 256 candidates.
    nucleus = SamplingParams(max_tokens=11, temperature=3.0, top_k=450, top_p=0.99, seed=7)
    arrivals: Arrivals = {
        0: [
            ("a", prompts[0], greedy(14)),
            ("b", prompts[1], greedy(5)),
            ("c", prompts[2], greedy(10, stop_token_ids=(stop_token,))),
            ("m", prompts[2], greedy(10, min_tokens=6, stop_token_ids=(stop_token,))),
            ("g", prompts[1], sampled),
            ("h", prompts[3], nucleus),
        ],
        4: [("d", prompts[3], greedy(9))],
        6: [("e", prompts[4], greedy(8, logprobs=1))],
        13: [("f", prompts[5], greedy(6))],
    }
    return arrivals, {9: ["a"]}
