"""Outside-in: forged UCX messages sent to a real decode worker change no request's output.

A real cluster (``splitserve up``: coordinator, 1 prefill and 1 decode worker as processes,
float32, prefix caching off) serves concurrent greedy requests whose prompts are all
prefilled on the prefill worker and pushed layer by layer over UCX into blocks the decode
worker reserved. Meanwhile an attacker in this process keeps sending poison messages (float32
1e30 everywhere, of the sizes real messages have: the K or V of a run of 1 to 3 blocks) to the
decode worker's UCX address, under every tag the old packing ``transfer_id << 20 | message
index`` gives for the transfer ids an attacker would have tried (the first ones of a
sequential count, and 0: bare indices) and every message index of a one-run transfer (the
decode worker reserves contiguous blocks, so one run is the rule). Its first round is queued
before any request starts (UCX would hand such an unexpected message to a receive posted
later under its tag), the rest arrives while the transfers run (to receives already posted).

Every request must end with exactly the tokens it gets without the attack, which are
themselves checked against the in-process engine; every transfer must land on its first try
(the decode worker's transfer metrics: one more completed receive per prompt, of exactly the
prompt's KV bytes, no failure) and every block must be free afterwards.

Why it can fail: had a forged message matched a posted receive, it would have written 1e30
into a reserved block's K or V (a planned size lands whole, a shorter one partly, or fails the
transfer under the canary, ``ucx.py``; a longer one fails it as truncated): attention over such
a key or value overflows and the greedy tokens that follow are garbage; a transfer that fails,
or never completes because forged messages took its receives, shows in the metrics. Only the
unguessable tags (keyed hashes of a per-reservation secret, ``plan.message_tag``) keep the
poison in UCX's unexpected-message queue.

Limits: the attacker gets the decode worker's UCX address through ``KvHandshake`` with the
cluster credential, which grants it more than a stranger has (a stranger would have to learn
the address otherwise, e.g. from the TCP ports UCX listens on); it guesses tags, never the
secret. Old transfer ids started at a random offset, then counted up: the ids tried here stand
for "ids an attacker predicted", not the ones the old code would have drawn. Only the first 60
message indices are tried per id (30 layers x K and V of one run), and the volume is capped
(``BUDGET_BYTES``), so the decode worker is never flooded into failing for another reason.
In-process, with a known transfer id, ``test_transfer_security.py`` covers the same attack.

Checked by hand against a copy of the code with the old tags (transfer ids counting from 1,
``id << 20 | index``): there this test fails, as no attacked transfer completes (forged
messages take the posted receives, the prefill worker's rendezvous sends then find none, and
the coordinator recovers each request by prefilling it on the decode worker, with the right
tokens); with every prompt one block long, 1-block poison only and the workers sending
eagerly too (``UCX_RNDV_THRESH=inf`` in their environment), the poison lands and every token
after the prefill worker's first is token 0.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc
import pytest
import torch

from splitserve.client import AsyncClient, Chunk, Finish, Sampling
from splitserve.common.kv_layout import KvLayout
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.checkpoint import LoadedCheckpoint
from splitserve.engine.config import CacheConfig, EngineConfig, ModelConfig, RunnerConfig
from splitserve.engine.llm import LLM
from splitserve.proto import convert
from splitserve.proto.splitserve.v1 import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from splitserve.transfer.transport import KvEndpoint
from splitserve.transfer.ucx import UcxTransport
from splitserve.worker.kv_io import kv_layout_of
from tests.cluster import (
    CREDENTIAL,
    assert_all_free,
    cluster,
    internal_address,
    transfer_figures,
    wait_until_idle,
    worker_loads,
)

pytestmark = pytest.mark.timeout(300)

WORKER_FLAGS = ("--dtype=float32", "--num-blocks=256", "--threads=1", "--no-prefix-caching")
"""Prefix caching off: the attacked pass pushes every prompt block again, none is cached."""
BLOCK_SIZE = 16
PROMPT_SPANS = ((0, 9), (7, 17), (30, 25), (50, 40), (3, 47), (90, 77), (120, 130))
"""(offset, length) of each prompt in the tokenized ``PROMPT_TEXT``: 1 to 9 blocks, no length
a whole number of blocks (the coordinator would take such a prompt, pushed once, for cached
and prefill it on the decode worker the second time: no transfer to attack)."""
PROMPT_TEXT = (
    "The lighthouse keeper wrote in his log every night: the wind, the height of the waves, "
    "the ships that passed and the ones that did not. Over forty years the log grew into a "
    "history of the coast, its storms and its quiet summers, its wrecks and its rescues. "
    "When he retired, the town asked him what he would miss most, and he said the silence "
    "between two beams of light, when the sea could be anything at all. "
) * 3
MAX_TOKENS = 16
"""Greedy tokens per request, all of them (``min_tokens``): enough that any disturbed KV shows
(a key or value of 1e30 overflows attention at the first token that reads it)."""

OLD_MESSAGE_BITS = 20
"""The old tag packing: ``transfer_id << 20 | message index``."""
OLD_TRANSFER_IDS = range(0, 17)
"""0 (bare indices) and 1..16: more than the 14 transfers this test makes."""
POISON_BLOCKS = (1, 2, 3)
"""Poison sizes, the K or V of a run of this many blocks, cycled over the tags."""
FIRST_BATCH = 100
"""Sends in flight at once while queuing the first round."""
BATCH, PAUSE_S = 4, 0.02
"""While requests stream: this many sends, then a pause, round after round."""
BUDGET_BYTES = 64 << 20
"""The most the attacker sends in all (UCX keeps every unreceived message)."""
SEND_TIMEOUT_S = 30.0

Output = tuple[tuple[int, ...], str]
"""A request's tokens and finish reason."""


@dataclass
class Streamed:
    """Every request's output, when they started, and when the last one had its first token
    (by then every prompt's KV had landed)."""

    outputs: list[Output]
    started: float
    all_first_tokens: float


class Attacker:
    """Sends poison under old-style tags to one UCX endpoint (``attacker_transport``);
    ``sent_at`` holds the time each send completed."""

    def __init__(self, endpoint: KvEndpoint, layout: KvLayout) -> None:
        self.endpoint = endpoint
        block_floats = layout.block_size * layout.num_kv_heads * layout.head_dim
        self.poison = [
            torch.full((n * block_floats,), 1e30).view(torch.uint8) for n in POISON_BLOCKS
        ]
        self.tags = old_style_tags(layout.num_layers)
        self.sent_at: list[float] = []
        self.sent_bytes = 0
        self.first_round_sent = 0

    async def first_round(self) -> None:
        """Every tag once, before any request starts."""
        for start in range(0, len(self.tags), FIRST_BATCH):
            await self._sends(range(start, min(start + FIRST_BATCH, len(self.tags))), 0)
        self.first_round_sent = len(self.sent_at)

    async def keep_on(self, stop: asyncio.Event) -> None:
        """Round after round over the tags, sizes rotated, until ``stop`` or the budget."""
        round_ = 1
        while True:
            for start in range(0, len(self.tags), BATCH):
                if stop.is_set() or self.sent_bytes >= BUDGET_BYTES:
                    return
                await self._sends(range(start, min(start + BATCH, len(self.tags))), round_)
                await asyncio.sleep(PAUSE_S)
            round_ += 1

    def sent_between(self, start: float, end: float) -> int:
        return sum(start <= moment <= end for moment in self.sent_at)

    async def _send(self, position: int, round_: int) -> None:
        message = self.poison[(position + round_) % len(self.poison)]
        await self.endpoint.send(self.tags[position], message)
        self.sent_at.append(time.monotonic())
        self.sent_bytes += message.numel()

    async def _sends(self, positions: range, round_: int) -> None:
        sends = (self._send(position, round_) for position in positions)
        await asyncio.wait_for(asyncio.gather(*sends), SEND_TIMEOUT_S)


def old_style_tags(num_layers: int) -> list[int]:
    """``id << 20 | index`` for each id of ``OLD_TRANSFER_IDS`` and each message index of a
    one-run transfer (K and V per layer)."""
    indices = range(num_layers * 2)
    return [(tid << OLD_MESSAGE_BITS) | index for tid in OLD_TRANSFER_IDS for index in indices]


def sampling() -> Sampling:
    return Sampling(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0.0)


def engine_reference(
    checkpoint: LoadedCheckpoint,
) -> tuple[list[list[int]], list[Output], KvLayout]:
    """The prompts (token ids), their greedy float32 outputs from the in-process engine, and
    the KV layout of a float32 worker of this model. One torch thread, like the workers (two
    spin-wait for each other on a busy 2-core machine: 30 times slower there, seen)."""
    threads = torch.get_num_threads()
    config = EngineConfig(
        model=ModelConfig(dtype="float32"),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=512, enable_prefix_caching=False),
        runner=RunnerConfig(num_threads=1),
    )
    try:
        llm = LLM(config=config, checkpoint=checkpoint)
        ids = llm.encode_prompt(PROMPT_TEXT)
        prompts = [ids[offset : offset + length] for offset, length in PROMPT_SPANS]
        assert [len(p) for p in prompts] == [length for _, length in PROMPT_SPANS]
        params = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0.0)
        outputs = [
            (tuple(o.token_ids), o.finish_reason.value) for o in llm.generate(prompts, params)
        ]
        return prompts, outputs, kv_layout_of(llm.engine.facts, llm.engine.paged_kv)
    finally:
        torch.set_num_threads(threads)


async def stream_all(address: str, prompts: Sequence[list[int]]) -> Streamed:
    """Stream every prompt at once (see ``Streamed``)."""
    outputs: list[Output] = [((), "")] * len(prompts)
    first_tokens: list[float] = []

    async def one(client: AsyncClient, index: int) -> None:
        tokens: list[int] = []
        async for item in client.stream(token_ids=prompts[index], sampling=sampling()):
            if isinstance(item, Chunk):
                if not tokens:
                    first_tokens.append(time.monotonic())
                tokens.extend(item.token_ids)
            elif isinstance(item, Finish):
                outputs[index] = (tuple(tokens), item.finish_reason)

    async with AsyncClient(address) as client:
        started = time.monotonic()
        await asyncio.gather(*(one(client, i) for i in range(len(prompts))))
    return Streamed(outputs, started, max(first_tokens, default=started))


async def decode_ucx_address(coordinator_internal: str, layout: KvLayout) -> bytes:
    """The decode worker's UCX address as its ``KvHandshake`` hands it out (with the cluster
    credential: see the module docstring, Limits)."""
    async with grpc.aio.insecure_channel(coordinator_internal) as channel:
        listing = await coordinator_pb2_grpc.MembershipStub(channel).ListWorkers(
            coordinator_pb2.ListWorkersRequest(), timeout=10, metadata=CREDENTIAL.metadata
        )
    (decode,) = [
        s.worker for s in listing.workers if s.worker.role == worker_pb2.WORKER_ROLE_DECODE
    ]
    async with grpc.aio.insecure_channel(decode.address) as channel:
        reply = await worker_pb2_grpc.DecodeWorkerStub(channel).KvHandshake(
            worker_pb2.KvHandshakeRequest(layout=convert.layout_to_proto(layout)),
            timeout=10,
            metadata=CREDENTIAL.metadata,
        )
    assert reply.transport == "ucx"
    return reply.ucx_address


async def attacked_pass(
    address: str, prompts: Sequence[list[int]], layout: KvLayout
) -> tuple[Streamed, Attacker]:
    """Stream every prompt while the attacker sends: a first round of poison queued before,
    then more until every stream has ended."""
    transport = attacker_transport()
    try:
        endpoint = await transport.connect(
            await decode_ucx_address(internal_address(address), layout)
        )
        attacker = Attacker(endpoint, layout)
        await attacker.first_round()
        stop = asyncio.Event()
        attacking = asyncio.create_task(attacker.keep_on(stop))
        try:
            streamed = await stream_all(address, prompts)
        finally:
            stop.set()
            await asyncio.wait_for(attacking, SEND_TIMEOUT_S)
        return streamed, attacker
    finally:
        await transport.close()


def attacker_transport() -> UcxTransport:
    """The attacker's UCX, configured as it likes: rendezvous off, so each poison message goes
    eagerly, whole, into the decode worker's unexpected-message queue, and its send completes
    unreceived. (Only this process's context: the workers keep their own configuration.)"""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UCX_RNDV_THRESH", "inf")
        return UcxTransport()


def kv_bytes(layout: KvLayout, prompts: Sequence[list[int]]) -> int:
    """KV bytes of every layer of these prompts' blocks: what their transfers land."""
    blocks = [math.ceil(len(prompt) / layout.block_size) for prompt in prompts]
    return sum(layout.layer_bytes(n) * layout.num_layers for n in blocks)


@pytest.fixture
def fresh_ucxx() -> Iterator[None]:
    """After the test this process's ucxx context is reset (ucxx allows one per process)."""
    ucxx = pytest.importorskip("ucxx")
    yield
    ucxx.reset()


# a whole cluster under a forger; test_transfer_security checks each forged message by default
@pytest.mark.slow
@pytest.mark.usefixtures("fresh_ucxx")
def test_forged_ucx_messages_change_no_output(default_checkpoint_fp32: LoadedCheckpoint) -> None:
    prompts, expected, layout = engine_reference(default_checkpoint_fp32)
    assert {math.ceil(len(p) / BLOCK_SIZE) for p in prompts} >= set(POISON_BLOCKS)
    assert expected == [(tokens, "length") for tokens, _ in expected]
    announced: dict[str, str] = {}
    with cluster(1, 1, *WORKER_FLAGS, ready_lines=announced, up_flags=("--no-gateway",)) as address:
        metrics_url = announced["decode metrics"]
        assert asyncio.run(stream_all(address, prompts)).outputs == expected  # no attack yet

        before = transfer_figures(metrics_url)
        prefilled = worker_loads(address)["prefill-0"].num_finished_requests
        streamed, attacker = asyncio.run(attacked_pass(address, prompts, layout))
        assert streamed.outputs == expected

        after = transfer_figures(metrics_url)
        # every prompt was pushed over UCX once, landed whole, and no transfer failed
        assert after.completed - before.completed == len(prompts)
        assert after.landed_bytes - before.landed_bytes == kv_bytes(layout, prompts)
        assert after.failures == before.failures == 0
        loads = wait_until_idle(address, 2)
        assert loads["prefill-0"].num_finished_requests - prefilled == len(prompts)
        assert_all_free(loads, 2)

    # the attack really happened: every tag tried before the requests, more while KV landed
    assert attacker.first_round_sent == len(attacker.tags) > 0
    landing = attacker.sent_between(streamed.started, streamed.all_first_tokens)
    assert landing > 0, (landing, streamed)
    seconds = streamed.all_first_tokens - streamed.started
    print(f"{len(attacker.sent_at)} forged messages, {attacker.sent_bytes >> 20} MiB;")
    print(f"{landing} of them in the {seconds:.2f} s until every prompt's KV had landed")
