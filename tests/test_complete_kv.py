"""``CompleteKv`` input checks on the decode worker (in-process transport, float32): a first
token the prefill side got wrong fails that request alone with ``InvalidRequestError`` naming
the field, its blocks come back, and another request on the same worker, decoding meanwhile,
still produces its reference output token for token. Every bound of ``FirstToken.check`` is
tested on its own; the worker test runs the out-of-vocabulary token (the one that used to
fail the whole batch)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence

import pytest

from splitserve.common.errors import InvalidRequestError
from splitserve.common.logprobs import TokenLogprob
from splitserve.common.request_update import FinishReason, StepOutput
from splitserve.common.sampling_params import SamplingParams
from splitserve.decode.worker import DecodeWorker
from splitserve.engine.checkpoint import LoadedCheckpoint
from splitserve.engine.engine_core import CompletedPrompt, EngineCore
from splitserve.transfer.inprocess import InProcessTransport
from splitserve.transfer.layer_channel import LayerSender
from splitserve.transfer.reservation import FirstToken, KvReservation
from splitserve.transfer.transport import KvEndpoint
from splitserve.worker.kv_io import gather_layer, staging_buffer
from tests.conftest import make_llm
from tests.test_decode_receive import NUM_BLOCKS, PROMPT, decode_worker, free_blocks, wait_for_free

pytestmark = pytest.mark.timeout(120)

LONG = SamplingParams(max_tokens=32, min_tokens=32, temperature=0.0)
"""Long enough that the good request is still decoding when the bad CompleteKv arrives."""
VOCAB = 49152
"""The default model's vocabulary (SmolLM2)."""
BAD_FIRST_TOKENS = {
    "out-of-vocab": (FirstToken(VOCAB), "first_token_id"),
    "negative": (FirstToken(-1), "first_token_id"),
    "too-many-cached": (FirstToken(7, num_cached_tokens=len(PROMPT) + 1), "num_cached_tokens"),
    "logprob-of-another-token": (
        FirstToken(7, TokenLogprob(8, -0.1, 1, ((8, -0.1),))),
        "first_logprob",
    ),
    "top-logprob-out-of-vocab": (
        FirstToken(7, TokenLogprob(7, -0.1, 1, ((VOCAB + 3, -0.1),))),
        "first_logprob",
    ),
}


async def reserve(worker: DecodeWorker, request_id: str) -> tuple[AsyncIterator, KvReservation]:
    stream = worker.generate(request_id, PROMPT, LONG, remote_prefill=True)
    reservation = await anext(stream)
    assert isinstance(reservation, KvReservation)
    return stream, reservation


async def prefill_and_push(
    checkpoint: LoadedCheckpoint, decode_transport: bytes, target: KvReservation
) -> int:
    """What a prefill worker does: compute the prompt on its own engine, push each layer's KV
    into ``target`` (at the decode worker's transport address) as it is written; returns the
    first token."""
    prefill = make_llm(checkpoint, num_blocks=NUM_BLOCKS).engine
    transport = InProcessTransport()
    try:
        return await _push(prefill, await transport.connect(decode_transport), target)
    finally:
        await transport.close()


async def _push(prefill: EngineCore, endpoint: KvEndpoint, target: KvReservation) -> int:
    loop = asyncio.get_running_loop()
    num_layers = prefill.runner.kv_cache.shape[0]
    sender = LayerSender(
        endpoint, target.transfer_id, target.transfer_secret, num_layers, target.plan, loop
    )
    staging = staging_buffer(prefill.paged_kv, target.num_blocks)

    def push(layer: int, completed: Sequence[CompletedPrompt]) -> None:
        for prompt in completed:
            blocks = prompt.block_table[: target.num_blocks]
            sender.offer(
                layer, gather_layer(prefill.paged_kv, layer, blocks, target.plan, staging[layer])
            )

    prefill.add_request("good", PROMPT, dataclasses.replace(LONG, max_tokens=1, min_tokens=1))
    first = None
    while prefill.has_unfinished:
        for output in prefill.step(on_layer_kv_written=push):
            first = output.update.new_token_ids[0]
    await sender.finish(10.0)
    assert first is not None
    return first


async def tokens_of(stream: AsyncIterator) -> tuple[list[int], FinishReason | None]:
    outputs = [output async for output in stream]
    assert all(isinstance(output, StepOutput) for output in outputs)
    tokens = [token for output in outputs for token in output.update.new_token_ids]
    return tokens, outputs[-1].update.finish_reason if outputs else None


@pytest.mark.parametrize("case", list(BAD_FIRST_TOKENS))
def test_first_token_check_names_the_bad_field(case: str) -> None:
    bad_first, field = BAD_FIRST_TOKENS[case]
    with pytest.raises(InvalidRequestError) as caught:
        bad_first.check(VOCAB, len(PROMPT))
    assert caught.value.param == field


def test_first_token_check_accepts_the_bounds() -> None:
    FirstToken(0, num_cached_tokens=0).check(VOCAB, len(PROMPT))
    last = VOCAB - 1
    logprob = TokenLogprob(last, -0.5, 2, ((0, -0.1), (last, -0.5)))
    FirstToken(last, logprob, num_cached_tokens=len(PROMPT)).check(VOCAB, len(PROMPT))


@pytest.mark.slow  # a cluster; the engine's own refusal, below, runs by default
def test_an_out_of_vocab_first_token_fails_only_its_request(
    default_checkpoint_fp32: LoadedCheckpoint,
) -> None:
    bad_first, field = BAD_FIRST_TOKENS["out-of-vocab"]
    reference = make_llm(default_checkpoint_fp32).generate([PROMPT], LONG)[0].token_ids

    async def body() -> None:
        transport = InProcessTransport()
        async with decode_worker(default_checkpoint_fp32, transport) as worker:
            assert worker.engine.facts.vocab_size == VOCAB
            good_stream, good = await reserve(worker, "good")
            bad_stream, bad = await reserve(worker, "bad")
            first = await prefill_and_push(default_checkpoint_fp32, transport.address, good)
            await worker.complete_kv(good.transfer_id, "good", FirstToken(first))
            good_tokens = asyncio.ensure_future(tokens_of(good_stream))  # decoding now

            with pytest.raises(InvalidRequestError) as caught:
                await worker.complete_kv(bad.transfer_id, "bad", bad_first)
            assert caught.value.param == field
            assert await tokens_of(bad_stream) == ([], FinishReason.ABORT)
            assert not good_tokens.done()  # the bad token came while the good one decoded

            assert await asyncio.wait_for(good_tokens, 60) == (reference, FinishReason.LENGTH)
            await wait_for_free(worker, NUM_BLOCKS)  # the bad request's blocks came back too
            with pytest.raises(InvalidRequestError, match="no KV reservation"):
                await worker.complete_kv(bad.transfer_id, "bad", FirstToken(first))
            assert free_blocks(worker) == NUM_BLOCKS

    asyncio.run(body())


def test_the_engine_refuses_an_out_of_vocab_first_token_changing_nothing(
    default_checkpoint_fp32: LoadedCheckpoint,
) -> None:
    """The backstop under the worker's check: the engine never lets such a token into a batch."""
    engine = make_llm(default_checkpoint_fp32, num_blocks=NUM_BLOCKS).engine
    engine.reserve_remote_prefill("r0", PROMPT, LONG)
    with pytest.raises(InvalidRequestError) as caught:
        engine.complete_remote_prefill("r0", VOCAB)
    assert caught.value.param == "first_token_id"
    assert engine.has_request("r0") and not engine.has_unfinished  # still waiting for its KV
    engine.complete_remote_prefill("r0", 7)
    assert engine.has_unfinished
