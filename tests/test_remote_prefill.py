"""Disaggregation inside one process: one engine prefills, pushes each layer's KV into blocks
another engine reserved, and the second one decodes. Output equals a single engine's, token for
token (float32, batch invariant), and both engines end with every block free."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import pytest

from splitserve.common.blocks import blocks_for_tokens
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.checkpoint import LoadedCheckpoint
from splitserve.engine.engine_core import CompletedPrompt
from splitserve.engine.llm import LLM
from tests.conftest import assert_no_leaks, make_llm

GREEDY = SamplingParams(max_tokens=16, min_tokens=16, temperature=0.0)
SEEDED = SamplingParams(max_tokens=16, min_tokens=16, temperature=0.9, top_p=0.95, seed=1234)


@pytest.mark.parametrize(
    "params",
    # greedy is slow: the seeded case also checks the generator's hand-over
    [pytest.param(GREEDY, id="greedy", marks=pytest.mark.slow), pytest.param(SEEDED, id="seeded")],
)
def test_layerwise_push_into_reserved_blocks_matches_colocated(
    default_checkpoint_fp32: LoadedCheckpoint, params: SamplingParams
) -> None:
    """Seeded sampling too: the decode side continues the seed's random stream after the
    token the prefill side sampled."""
    colocated = make_llm(default_checkpoint_fp32, num_blocks=128)
    prefill = make_llm(default_checkpoint_fp32, num_blocks=64, max_num_batched_tokens=48)
    decode = make_llm(default_checkpoint_fp32, num_blocks=64)
    texts = ["The capital of France is", "Write a short poem about rain. " * 6, "def add(a, b):"]
    prompts = [colocated.encode_prompt(text) for text in texts]
    expected = [result.token_ids for result in colocated.generate(prompts, params)]

    reserved = {
        f"r{i}": decode.engine.reserve_remote_prefill(f"r{i}", prompt, params)
        for i, prompt in enumerate(prompts)
    }

    block_size = prefill.engine.config.cache.block_size
    prompt_lengths = dict(zip(reserved, map(len, prompts), strict=True))

    def push_layer(layer: int, completed: Sequence[CompletedPrompt]) -> None:
        for prompt in completed:  # the whole prompt's blocks, partial last block too
            num_blocks = blocks_for_tokens(prompt_lengths[prompt.request_id], block_size)
            kv = prefill.engine.runner.read_kv_blocks(layer, prompt.block_table[:num_blocks])
            target = reserved[prompt.request_id][:num_blocks]
            decode.engine.runner.write_kv_blocks(layer, target, kv)

    first_only = dataclasses.replace(params, max_tokens=1, min_tokens=1)
    for request_id, prompt in zip(reserved, prompts, strict=True):
        prefill.engine.add_request(request_id, prompt, first_only)
    first_tokens = {}
    while prefill.engine.has_unfinished:  # prompts are chunked: 48 tokens per step
        for output in prefill.engine.step(on_layer_kv_written=push_layer):
            first_tokens[output.update.request_id] = output.update.new_token_ids[0]
    assert_no_leaks(prefill)

    generated = {request_id: [token] for request_id, token in first_tokens.items()}
    for request_id, token in first_tokens.items():
        decode.engine.complete_remote_prefill(request_id, token)
    while decode.engine.has_unfinished:
        for output in decode.engine.step():
            generated[output.update.request_id].extend(output.update.new_token_ids)
    assert [generated[request_id] for request_id in reserved] == expected
    assert_no_leaks(decode)


def test_a_conversations_next_turn_moves_only_what_the_decode_engine_lacks(
    default_checkpoint_fp32: LoadedCheckpoint,
) -> None:
    """The decode engine decoded turn 1, so its prefix cache holds the prompt and the reply;
    turn 2 (turn 1 + reply + a new message) reserves those blocks from its cache and only the
    rest is pushed, yet the tokens equal the colocated engine's (float32)."""
    colocated = make_llm(default_checkpoint_fp32, num_blocks=128)
    prefill = make_llm(default_checkpoint_fp32, num_blocks=64)
    decode = make_llm(default_checkpoint_fp32, num_blocks=64)
    params = SamplingParams(max_tokens=20, min_tokens=20, temperature=0.0)
    turn1 = colocated.encode_prompt("Once upon a time, in a land far away, there lived " * 3)
    (reply,) = decode.generate([turn1], params)  # decoded here: its blocks are cached here
    turn2 = turn1 + list(reply.token_ids) + colocated.encode_prompt(" And then?")
    (expected,) = colocated.generate([turn2], params)

    core = decode.engine
    reserved = core.reserve_request(core.remote_prefill_request("t2", turn2, params))
    block_size = core.config.cache.block_size
    held = len(turn1) + len(reply.token_ids) - 1  # the reply's last token was never computed
    assert reserved.num_cached_blocks == held // block_size > 0
    assert len(reserved.block_ids) == blocks_for_tokens(len(turn2), block_size)

    sent: list[int] = []

    def push_layer(layer: int, completed: Sequence[CompletedPrompt]) -> None:
        for prompt in completed:  # only the blocks after the ones the decode engine holds
            first, count = reserved.num_cached_blocks, len(reserved.receiving)
            kv = prefill.engine.runner.read_kv_blocks(
                layer, prompt.block_table[first : first + count]
            )
            decode.engine.runner.write_kv_blocks(layer, reserved.receiving, kv)
            sent.append(count)

    assert _prefill_then_decode(prefill, decode, turn2, params, push_layer) == list(
        expected.token_ids
    )
    assert set(sent) == {len(reserved.receiving)}
    assert_no_leaks(prefill)
    assert_no_leaks(decode)


@pytest.mark.slow  # the next turn's hand-over above runs by default
def test_a_turn_whose_earlier_blocks_were_evicted_moves_them_all_again(
    default_checkpoint_fp32: LoadedCheckpoint,
) -> None:
    """The decode engine's cache lost turn 1 (another prompt took the blocks) between the
    turns: the reservation finds nothing cached, every block travels, the tokens are the
    same (a stale belief about what a worker holds costs bytes, never a token)."""
    colocated = make_llm(default_checkpoint_fp32, num_blocks=128)
    prefill = make_llm(default_checkpoint_fp32, num_blocks=64)
    decode = make_llm(default_checkpoint_fp32, num_blocks=12)
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0)
    turn1 = colocated.encode_prompt("Once upon a time, in a land far away, there lived " * 2)
    (reply,) = decode.generate([turn1], params)
    # 180 + 12 tokens: all 12 blocks of the pool, so turn 1's cached blocks are taken too
    (other,) = decode.generate([list(range(1000, 1180))], params)
    assert len(other.token_ids) == 12
    turn2 = turn1 + list(reply.token_ids) + colocated.encode_prompt(" And then?")
    (expected,) = colocated.generate([turn2], params)

    core = decode.engine
    reserved = core.reserve_request(core.remote_prefill_request("t2", turn2, params))
    assert reserved.num_cached_blocks == 0
    assert reserved.receiving == reserved.block_ids

    def push_layer(layer: int, completed: Sequence[CompletedPrompt]) -> None:
        for prompt in completed:
            count = len(reserved.block_ids)
            kv = prefill.engine.runner.read_kv_blocks(layer, prompt.block_table[:count])
            decode.engine.runner.write_kv_blocks(layer, reserved.receiving, kv)

    assert _prefill_then_decode(prefill, decode, turn2, params, push_layer) == list(
        expected.token_ids
    )
    assert_no_leaks(prefill)
    assert_no_leaks(decode)


def _prefill_then_decode(
    prefill: LLM,
    decode: LLM,
    prompt: list[int],
    params: SamplingParams,
    push_layer: Callable[[int, Sequence[CompletedPrompt]], None],
) -> list[int]:
    """Request "t2": ``prefill`` computes ``prompt`` and its first token, pushing each layer
    with ``push_layer``, then ``decode`` (holding the reservation) decodes the rest; its
    tokens."""
    first_only = dataclasses.replace(params, max_tokens=1, min_tokens=1)
    prefill.engine.add_request("t2", prompt, first_only)
    first = None
    while prefill.engine.has_unfinished:
        for output in prefill.engine.step(on_layer_kv_written=push_layer):
            first = output.update.new_token_ids[0]
    assert first is not None
    generated = [first]
    decode.engine.complete_remote_prefill("t2", first)
    while decode.engine.has_unfinished:
        for output in decode.engine.step():
            generated.extend(output.update.new_token_ids)
    return generated
