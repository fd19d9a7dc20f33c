"""The reverse transfer (issue 33): a prefill worker computing a conversation's next turn
receives the history's KV that the decode worker holds (its last reply, decoded there) instead
of computing it, and computes only the tokens after it.

In one engine pair (``EngineCore``): the pulled blocks enter the prefill engine's prefix cache
only once landed, the prompt's request then computes only the rest, and the tokens equal the
colocated engine's (float32). With the workers' domain objects on an in-process transport
(``PrefillWorker``, ``DecodeWorker``; the decode worker's gRPC calls made as direct calls, the
gRPC and UCX path being ``tests/test_serving_integration.py``'s): the whole handoff with a
pull, a pull refused by the decode worker for each bad field, and a pull that fails, after
which the prompt is computed as without it; the push teaches the prefill worker its link to
that decode worker (the figure its load reports). Every block of both engines ends free.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence

import pytest
import torch

from splitserve.common.errors import (
    IncompatibleKvLayoutError,
    InvalidRequestError,
    WorkerUnavailableError,
)
from splitserve.common.kv_push_cost import KvPushCosts
from splitserve.common.load import EngineLoad
from splitserve.common.request_update import StepOutput
from splitserve.common.sampling_params import SamplingParams
from splitserve.decode.worker import DecodeWorker
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.checkpoint import LoadedCheckpoint
from splitserve.engine.engine_core import CompletedPrompt
from splitserve.engine.engine_face import PulledKv
from splitserve.engine.llm import LLM
from splitserve.prefill import worker as prefill_module
from splitserve.prefill.worker import PrefillWorker
from splitserve.proto.cluster_access import ClusterAccess
from splitserve.proto.cluster_auth import ClusterCredential
from splitserve.transfer.inprocess import InProcessTransport
from splitserve.transfer.plan import TransferPlan, new_transfer_secret
from splitserve.transfer.reservation import CachedKvPull, FirstToken, KvReservation
from splitserve.worker.identity import WorkerIdentity
from splitserve.worker.runtime import reported_load
from splitserve.worker.transfer_settings import TransferSettings
from tests.conftest import assert_no_leaks, make_llm

pytestmark = pytest.mark.timeout(180)

BLOCK = 16
REPLY = SamplingParams(max_tokens=40, min_tokens=40, temperature=0.0)
NEXT = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0)


@dataclasses.dataclass
class Conversation:
    turn1: list[int]
    turn2: list[int]
    """``turn1``, its greedy reply of 40 tokens, a new message."""
    expected: list[int]
    """The colocated engine's greedy reply to ``turn2``."""


@pytest.fixture(scope="module")
def conversation(default_checkpoint_fp32: LoadedCheckpoint) -> Conversation:
    """Computed once for the module by the colocated float32 engine."""
    colocated = make_llm(default_checkpoint_fp32, num_blocks=128)
    turn1 = colocated.encode_prompt("Once upon a time, in a land far away, there lived " * 3)
    (reply,) = colocated.generate([turn1], REPLY)
    turn2 = turn1 + list(reply.token_ids) + colocated.encode_prompt(" And then what happened?")
    (expected,) = colocated.generate([turn2], NEXT)
    return Conversation(turn1, turn2, list(expected.token_ids))


def _first_turn(prefill: LLM, decode: LLM, conversation: Conversation) -> None:
    """Turn 1 as a cluster serves it: its prompt computed on ``prefill`` (its full blocks
    enter that cache), the reply decoded on ``decode`` (prompt and reply enter that one)."""
    prefill.generate([conversation.turn1], dataclasses.replace(REPLY, max_tokens=1, min_tokens=1))
    decode.generate([conversation.turn1], REPLY)


def _pulled(decode: LLM, block_ids: Sequence[int], first_block: int) -> PulledKv:
    """What the decode engine's ``block_ids`` hold, as a prefill worker receives it."""
    runner = decode.engine.runner
    layers = range(runner.kv_cache.shape[0])
    kv = torch.stack([runner.read_kv_blocks(layer, block_ids) for layer in layers])
    return PulledKv(first_block, kv)  # [layers, 2, blocks, block, kv_heads, dim]


@pytest.mark.slow  # test_serving_integration pulls a turn's prefix in a cluster
def test_a_pulled_prefix_is_computed_no_more_and_the_tokens_are_the_same(
    default_checkpoint_fp32: LoadedCheckpoint, conversation: Conversation
) -> None:
    prefill = make_llm(default_checkpoint_fp32, num_blocks=64)
    decode = make_llm(default_checkpoint_fp32, num_blocks=64)
    _first_turn(prefill, decode, conversation)
    turn2 = conversation.turn2

    core = decode.engine
    reserved = core.reserve_request(core.remote_prefill_request("t2", turn2, NEXT))
    held = reserved.num_cached_blocks
    own = len(conversation.turn1) // BLOCK
    assert held == (len(conversation.turn1) + 40 - 1) // BLOCK > own + 1

    # the prompt's request takes the pulled blocks in, after the ones its engine holds
    pulled = _pulled(decode, reserved.block_ids[own:held], own)
    assert prefill.engine.adopt_pulled_kv(turn2, pulled) == held - own
    prefill.engine.add_request("t2", turn2, dataclasses.replace(NEXT, max_tokens=1, min_tokens=1))

    def push_layer(layer: int, completed: Sequence[CompletedPrompt]) -> None:
        for prompt in completed:  # only what the decode engine lacks
            kv = prefill.engine.runner.read_kv_blocks(
                layer, prompt.block_table[held : held + len(reserved.receiving)]
            )
            core.runner.write_kv_blocks(layer, reserved.receiving, kv)

    first = None
    while prefill.engine.has_unfinished:
        for output in prefill.engine.step(on_layer_kv_written=push_layer):
            first = output.update
    assert first is not None
    assert first.num_cached_tokens == held * BLOCK  # computed: only the tokens after them
    assert_no_leaks(prefill)

    generated = list(first.new_token_ids)
    core.complete_remote_prefill("t2", generated[0])
    while core.has_unfinished:
        for output in core.step():
            generated.extend(output.update.new_token_ids)
    assert generated == conversation.expected
    assert_no_leaks(decode)


@pytest.mark.slow  # 4 s
def test_pulled_kv_that_does_not_follow_the_cached_prefix_is_not_taken(
    default_checkpoint_fp32: LoadedCheckpoint, conversation: Conversation
) -> None:
    """KV pulled after blocks the engine no longer holds (evicted meanwhile) would leave a
    gap: none of it enters the cache, and the prompt is computed whole. Pulled blocks the
    engine already holds, a prefix cache turned off, blocks reaching the last token: nothing
    taken either. No block is left held."""
    prefill = make_llm(default_checkpoint_fp32, num_blocks=64)
    decode = make_llm(default_checkpoint_fp32, num_blocks=64)
    decode.generate([conversation.turn1], REPLY)
    turn2 = conversation.turn2
    core = decode.engine
    reserved = core.reserve_request(core.remote_prefill_request("t2", turn2, NEXT))
    held = reserved.num_cached_blocks
    gap = _pulled(decode, reserved.block_ids[2:held], 2)  # the prefill engine holds nothing
    assert prefill.engine.adopt_pulled_kv(turn2, gap) == 0
    whole = _pulled(decode, reserved.block_ids[:held], 0)
    past_the_end = dataclasses.replace(whole, first_block=len(turn2) // BLOCK - held + 1)
    assert prefill.engine.adopt_pulled_kv(turn2, past_the_end) == 0
    uncached = make_llm(default_checkpoint_fp32, num_blocks=64, prefix_caching=False)
    assert uncached.engine.adopt_pulled_kv(turn2, whole) == 0
    assert_no_leaks(prefill)
    (result,) = prefill.generate([turn2], dataclasses.replace(NEXT, max_tokens=1, min_tokens=1))
    assert result.num_cached_tokens == 0
    assert prefill.engine.adopt_pulled_kv(turn2, whole) == 0  # it holds them all now
    core.abort_request("t2")
    assert_no_leaks(prefill)
    assert_no_leaks(decode)


class _DirectCalls:
    """The decode worker's calls a prefill worker makes, as direct calls on its domain
    object; ``refuse_pulls``: every ``push_cached_kv`` fails as an unreachable worker's."""

    def __init__(self, worker: DecodeWorker, refuse_pulls: bool = False) -> None:
        self.worker = worker
        self.refuse_pulls = refuse_pulls

    async def push_cached_kv(self, pull: CachedKvPull, timeout_s: float) -> int:
        if self.refuse_pulls:
            raise WorkerUnavailableError("the decode worker is unreachable")
        return await self.worker.push_cached_kv(pull)

    async def complete_kv(
        self, reservation: KvReservation, request_id: str, first: FirstToken, timeout_s: float
    ) -> None:
        await self.worker.complete_kv(reservation.transfer_id, request_id, first)


@dataclasses.dataclass
class _Pair:
    prefill: PrefillWorker
    decode: DecodeWorker
    calls: _DirectCalls


@contextlib.asynccontextmanager
async def _workers(
    checkpoint: LoadedCheckpoint, conversation: Conversation, refuse_pulls: bool = False
) -> AsyncIterator[_Pair]:
    """A prefill and a decode worker that served ``conversation``'s first turn, on
    in-process transports; the prefill worker pulls from one block on."""
    prefill_llm = make_llm(checkpoint, num_blocks=64)
    decode_llm = make_llm(checkpoint, num_blocks=64)
    _first_turn(prefill_llm, decode_llm, conversation)
    transports = InProcessTransport(), InProcessTransport()
    access = ClusterAccess(ClusterCredential.generate())
    prefill = PrefillWorker(
        AsyncEngine(prefill_llm.engine),
        transports[0],
        WorkerIdentity("prefill-0", "127.0.0.1:1", access),
        TransferSettings(10.0, pull_min_blocks=1),
    )
    decode = DecodeWorker(
        AsyncEngine(decode_llm.engine),
        transports[1],
        WorkerIdentity("decode-0", "127.0.0.1:2"),
        TransferSettings(10.0),
    )
    calls = _DirectCalls(decode, refuse_pulls)
    endpoint = await transports[0].connect(transports[1].address)
    peer = prefill_module._Peer(calls, endpoint, transports[1].address)  # type: ignore[arg-type]

    async def linked(address: str) -> prefill_module._Peer:
        return peer

    prefill._peer = linked  # type: ignore[method-assign]
    try:
        yield _Pair(prefill, decode, calls)
    finally:
        for worker in (prefill, decode):
            await worker.close()
            worker.engine.shutdown()
        for transport in transports:
            await transport.close()
        assert_no_leaks(prefill_llm)
        assert_no_leaks(decode_llm)


async def _serve_turn(pair: _Pair, turn: list[int]) -> tuple[list[int], int]:
    """``turn`` through both workers as the coordinator runs it: the decode stream's
    reservation to the prefill worker, then the stream's tokens; (tokens, cached tokens)."""
    stream = pair.decode.generate("t2", turn, NEXT, remote_prefill=True)
    reservation = await anext(stream)
    assert isinstance(reservation, KvReservation)
    done = await pair.prefill.prefill("t2", turn, NEXT, reservation)
    tokens: list[int] = []
    async for output in stream:
        assert isinstance(output, StepOutput)
        tokens.extend(output.update.new_token_ids)
    return tokens, done.num_cached_tokens


async def _until_free(engine: AsyncEngine) -> None:
    for _ in range(200):
        load = engine.latest_load
        if load.num_free_blocks == load.num_total_blocks:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{engine.latest_load.num_free_blocks} blocks free")


@pytest.mark.parametrize(
    "refuse_pulls",
    [False, pytest.param(True, marks=pytest.mark.slow)],  # slow: 5 s, the fallback's walk
    ids=["pulled", "pull-failed"],
)
def test_the_workers_hand_a_turn_over_with_a_pull_or_without_one(
    default_checkpoint_fp32: LoadedCheckpoint, conversation: Conversation, refuse_pulls: bool
) -> None:
    held = (len(conversation.turn1) + 40 - 1) // BLOCK
    own = len(conversation.turn1) // BLOCK

    async def body() -> None:
        async with _workers(default_checkpoint_fp32, conversation, refuse_pulls) as pair:
            tokens, cached = await _serve_turn(pair, conversation.turn2)
            assert tokens == conversation.expected
            # the push taught the prefill worker its link to this decode worker (one push)
            push = pair.prefill.kv_push_costs()
            assert push.overall.pushes == 1
            assert [(address, cost.pushes) for address, cost in push.peers] == [
                (pair.decode.identity.address, 1)
            ]
            # ... and the worker's load report carries it (a decode domain has none)
            assert reported_load(EngineLoad(), [pair.decode, pair.prefill]).kv_push == push
            assert reported_load(EngineLoad(), [pair.decode]).kv_push == KvPushCosts()
            metrics = pair.prefill.transfer_metrics
            if refuse_pulls:  # computed as without the pull
                assert cached == own * BLOCK
                assert metrics.pulled_blocks._value.get() == 0
            else:
                assert cached == held * BLOCK
                assert metrics.pulled_blocks._value.get() == held - own
            for worker in (pair.prefill, pair.decode):
                await _until_free(worker.engine)

    asyncio.run(body())


def test_the_decode_worker_sends_only_cached_blocks_of_an_open_transfer(
    default_checkpoint_fp32: LoadedCheckpoint, conversation: Conversation
) -> None:
    held = (len(conversation.turn1) + 40 - 1) // BLOCK

    async def body() -> None:
        async with _workers(default_checkpoint_fp32, conversation) as pair:
            decode = pair.decode
            stream = decode.generate("t2", conversation.turn2, NEXT, remote_prefill=True)
            reservation = await anext(stream)
            assert isinstance(reservation, KvReservation)
            assert reservation.num_cached_blocks == held
            good = CachedKvPull(
                reservation.transfer_id,
                "t2",
                0,
                pair.prefill.transport.address,
                TransferPlan.for_destination(range(held)),
                new_transfer_secret(),
                decode.layout.compat_hash,
            )
            bad = {
                "transfer_id": dataclasses.replace(good, transfer_id=good.transfer_id ^ 1),
                "request_id": dataclasses.replace(good, request_id="t3"),
                "first_block": dataclasses.replace(good, first_block=1),
                # groups of 7 layers: they do not divide the model's 30
                "layers_per_message": dataclasses.replace(
                    good, plan=TransferPlan.for_destination(range(held), 7)
                ),
            }
            for field, pull in bad.items():
                with pytest.raises(InvalidRequestError) as error:
                    await decode.push_cached_kv(pull)
                named = field if field in ("first_block", "layers_per_message") else "transfer_id"
                assert error.value.param == named
            with pytest.raises(IncompatibleKvLayoutError):
                await decode.push_cached_kv(dataclasses.replace(good, compat_hash="other"))
            # the prefill side refuses a reservation grouping layers that do not divide 30
            plan = reservation.plan
            ungrouped = TransferPlan(plan.block_order, plan.run_lengths, layers_per_message=7)
            forged = dataclasses.replace(reservation, plan=ungrouped)
            with pytest.raises(InvalidRequestError, match="do not divide 30") as error:
                await pair.prefill.prefill("t2", conversation.turn2, NEXT, forged)
            assert error.value.param == "target"
            await stream.aclose()  # its reservation closes: nothing of it is sent any more
            with pytest.raises(InvalidRequestError):
                await decode.push_cached_kv(good)
            await _until_free(decode.engine)

    asyncio.run(body())
