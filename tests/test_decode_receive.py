"""The decode worker's side of a transfer, in one process over the in-process transport:
reserved blocks go back to the pool only once no message can land in them, a retry of the same
request id is not hit by the first attempt's teardown, and blocks whose receives never settle
stay out of the pool."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
import torch

from splitserve.common.request_update import StepOutput
from splitserve.common.sampling_params import SamplingParams
from splitserve.decode import worker as decode_worker_module
from splitserve.decode.worker import DecodeWorker
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.checkpoint import LoadedCheckpoint
from splitserve.transfer import layer_channel
from splitserve.transfer.inprocess import InProcessTransport
from splitserve.transfer.plan import message_tag
from splitserve.transfer.reservation import KvReservation
from splitserve.worker.identity import WorkerIdentity
from splitserve.worker.transfer_settings import TransferSettings
from tests.conftest import make_llm

pytestmark = pytest.mark.timeout(120)

NUM_BLOCKS = 32
PROMPT = list(range(100, 140))  # 40 tokens: 3 blocks
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def free_blocks(worker: DecodeWorker) -> int:
    """As of the engine's latest report (after every command batch and step)."""
    return worker.engine.latest_load.num_free_blocks


async def wait_for_free(worker: DecodeWorker, expected: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while free_blocks(worker) != expected:
        assert time.monotonic() < deadline, f"{free_blocks(worker)} blocks free, not {expected}"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def decode_worker(
    checkpoint: LoadedCheckpoint, transport: InProcessTransport
) -> AsyncIterator[DecodeWorker]:
    """A decode worker on its own engine and ``transport``; both closed on exit."""
    engine = AsyncEngine(make_llm(checkpoint, num_blocks=NUM_BLOCKS).engine)
    identity = WorkerIdentity("decode-0", "127.0.0.1:1")
    worker = DecodeWorker(engine, transport, identity, TransferSettings(5.0))
    try:
        yield worker
    finally:
        await worker.close()
        engine.shutdown()
        await transport.close()


async def reserve(worker: DecodeWorker, request_id: str) -> tuple[object, KvReservation]:
    stream = worker.generate(request_id, PROMPT, GREEDY, remote_prefill=True)
    reservation = await anext(stream)
    assert isinstance(reservation, KvReservation)
    return stream, reservation


def test_aborted_reservation_frees_its_blocks_and_a_late_message_never_lands(
    default_checkpoint_fp32: LoadedCheckpoint,
) -> None:
    async def body() -> None:
        transport = InProcessTransport()
        async with decode_worker(default_checkpoint_fp32, transport) as worker:
            stream, reservation = await reserve(worker, "r0")
            assert free_blocks(worker) == NUM_BLOCKS - reservation.num_blocks
            await stream.aclose()  # the caller went away before any KV arrived
            await wait_for_free(worker, NUM_BLOCKS)

            # A message of the stale transfer arriving now is never received into the cache.
            cache = worker.engine.paged_kv.cache
            before = cache.clone()
            layer_bytes = 2 * reservation.num_blocks * 16 * 3 * 64 * 4  # float32 K and V
            message = torch.full((layer_bytes,), 255, dtype=torch.uint8)  # layer 0's size
            endpoint = await transport.connect(transport.address)
            await endpoint.send(message_tag(reservation.transfer_secret, 0), message)
            assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))

    asyncio.run(body())


def test_a_retry_of_the_same_request_id_survives_the_first_attempts_teardown(
    default_checkpoint_fp32: LoadedCheckpoint,
) -> None:
    async def body() -> None:
        transport = InProcessTransport()
        async with decode_worker(default_checkpoint_fp32, transport) as worker:
            stream, _ = await reserve(worker, "r0")
            # The coordinator cancels the attempt (its prefill worker failed) and at once
            # retries with local prefill: the retry arrives while the teardown is under way.
            teardown = asyncio.create_task(stream.aclose())
            await asyncio.sleep(0)  # the teardown starts and runs to its first suspension
            retry = worker.generate("r0", PROMPT, GREEDY, remote_prefill=False)
            outputs = [output async for output in retry]
            await teardown
            assert all(isinstance(output, StepOutput) for output in outputs)
            final = outputs[-1].update
            assert final.finish_reason is not None and final.finish_reason.value == "length"
            assert sum(len(output.update.new_token_ids) for output in outputs) == 4
            await wait_for_free(worker, NUM_BLOCKS)

    asyncio.run(body())


class _NeverSettling(InProcessTransport):
    """Receives that never complete, withdrawals that do nothing: a peer stuck mid-message."""

    async def recv(self, tag: int, buffer: torch.Tensor) -> None:
        await asyncio.Event().wait()

    async def withdraw(self, tag: int) -> None:
        return None


def test_blocks_of_a_transfer_that_never_settles_are_quarantined(
    default_checkpoint_fp32: LoadedCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(layer_channel, "SETTLE_TIMEOUT_S", 0.2)

    async def body() -> None:
        transport = _NeverSettling()
        async with decode_worker(default_checkpoint_fp32, transport) as worker:
            stream, reservation = await reserve(worker, "r0")
            await stream.aclose()
            await asyncio.sleep(1.0)  # the settle timeout passes; the blocks must stay held
            assert free_blocks(worker) == NUM_BLOCKS - reservation.num_blocks
            assert not await worker.engine.has_request("r0")  # the request itself ended
            # ... and the quarantine is visible: the gauge counts the blocks held
            assert worker.transfer_metrics.unsettled_blocks._value.get() == reservation.num_blocks

    asyncio.run(body())


def test_a_retry_that_arrives_before_the_first_attempt_is_cancelled_waits_for_it(
    default_checkpoint_fp32: LoadedCheckpoint,
) -> None:
    async def body() -> None:
        transport = InProcessTransport()
        async with decode_worker(default_checkpoint_fp32, transport) as worker:
            first, _ = await reserve(worker, "r0")
            # The retry's RPC overtakes the first attempt's cancellation.
            retry = asyncio.create_task(
                collect(worker.generate("r0", PROMPT, GREEDY, remote_prefill=False))
            )
            await asyncio.sleep(0.2)
            assert not retry.done()  # it waits for the first attempt instead of failing
            await first.aclose()  # the cancellation arrives
            outputs = await asyncio.wait_for(retry, 30)
            assert sum(len(output.update.new_token_ids) for output in outputs) == 4
            assert outputs[-1].update.finish_reason.value == "length"
            await wait_for_free(worker, NUM_BLOCKS)

    asyncio.run(body())


def test_a_retry_supersedes_an_attempt_whose_caller_never_closes_it(
    default_checkpoint_fp32: LoadedCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A coordinator cut off from this worker never cancels its attempt; another coordinator
    took the stream over and retries the id here: after the wait the retry runs whole, and
    the stale attempt's late teardown does not touch it."""
    monkeypatch.setattr(decode_worker_module, "PREVIOUS_ATTEMPT_WAIT_S", 0.2)

    async def body() -> None:
        transport = InProcessTransport()
        async with decode_worker(default_checkpoint_fp32, transport) as worker:
            stale, _ = await reserve(worker, "r0")  # its caller is gone: never read again
            retry = worker.generate("r0", PROMPT, GREEDY, remote_prefill=False)
            first = await asyncio.wait_for(anext(retry), 30)
            await stale.aclose()  # the stale call's teardown, long after: a no-op now
            outputs = [first, *[output async for output in retry]]
            assert all(isinstance(output, StepOutput) for output in outputs)
            assert sum(len(o.update.new_token_ids) for o in outputs) == 4  # type: ignore[union-attr]
            assert outputs[-1].update.finish_reason.value == "length"  # type: ignore[union-attr]
            await wait_for_free(worker, NUM_BLOCKS)

    asyncio.run(body())


async def collect(stream: AsyncIterator[object]) -> list[StepOutput]:
    outputs = [output async for output in stream]
    assert all(isinstance(output, StepOutput) for output in outputs)
    return outputs  # type: ignore[return-value]
