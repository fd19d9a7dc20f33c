"""Outside-in fault matrix: no process is a single point of failure.

Real processes through their launch entry points (the shared ``ha_cluster`` of
``tests/fault_cluster.py``): etcd, 2 coordinators, 2 prefill and 2 decode workers (float32, KV
over UCX), the OpenAI gateway balancing over both coordinators. Each fault strikes while
``NUM_STREAMS`` greedy streams run through the ``openai`` SDK; then the victim is started
again, as a supervisor would:

- kill -9 of a coordinator (mid-stream), of a prefill worker (while prompts are still being
  prefilled), of a decode worker (mid-stream);
- SIGTERM (drain) of a coordinator, a prefill worker, a decode worker and the gateway;
- etcd stopped for ``ETCD_OUTAGE_S`` from the streams' first token on, then started again.

For each fault one line: sent / completed / failed / continued (recoveries the coordinators
counted: continuations after a coordinator died, resumes on another decode worker, prefill
fallbacks) / tokens lost and duplicated (against the uninterrupted reference, token by token)
/ blocks held on the workers afterwards / the longest stall a stream that had tokens saw
across the fault /
seconds until the cluster was whole again (every process serving, listed by every coordinator;
for etcd, counted from its return). Every harm figure is 0 and every stream equals its
uninterrupted reference. A rolling restart of every process, one at a time under continuous
load, loses nothing either.

Conversations too: sessions homed on a decode worker that is SIGKILLed between their turns,
or while their next turn streams, go on exactly on another.

The kill -9 of a coordinator and of a decode worker are in the default suite; the rest is
``slow``.
"""

from __future__ import annotations

import asyncio
import difflib
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import openai
import pytest

from splitserve.common.membership import Role
from splitserve.coordinator.router import session_home
from tests.cluster import wait_until_idle, worker_loads
from tests.fault_cluster import FaultCluster, RoleProcess
from tests.test_router import _worker

pytestmark = pytest.mark.timeout(900)

NUM_STREAMS = 32
CONSTRAINED_CHARS = "[a-z ,.]"
CONSTRAINT = CONSTRAINED_CHARS + "{600}"
"""The odd streams' structured output: lowercase prose no stream finishes in its tokens."""
MAX_TOKENS = 48
PROMPTS = [
    f"Here is a detailed account, written for a museum catalogue, of object number {n}, "
    "a small wooden box found in a fisherman's cottage on the northern coast. The account "
    "describes its wood, its carvings, its hinges and what was found inside it:"
    for n in range(NUM_STREAMS)
]
MID_STREAM_TOKENS = 8
"""Mid-stream faults strike once every stream has this many tokens."""
ETCD_OUTAGE_S = 10.0
DRAIN_EXIT_S = 120.0
"""How long a SIGTERMed process may take to drain and exit."""


@dataclass
class Stream:
    """What one SDK stream delivered."""

    tokens: list[str] = field(default_factory=list)
    """Each completion token's text (``logprobs.tokens``), in arrival order."""
    text: str = ""
    completion_tokens: int = -1
    finish_reason: str | None = None
    arrivals: list[float] = field(default_factory=list)
    """``time.monotonic()`` of each chunk that carried tokens."""
    error: str | None = None


@dataclass(frozen=True)
class Fault:
    """``victim``: a process name, or "etcd"; ``signum``: what it gets (etcd: stopped);
    ``strike_after``: tokens every stream has when it strikes (0: once any stream has one,
    while most prompts are still being prefilled)."""

    victim: str
    signum: signal.Signals
    strike_after: int

    @property
    def name(self) -> str:
        if self.victim == "etcd":
            return f"etcd down {ETCD_OUTAGE_S:.0f} s"
        return f"{self.signum.name} {self.victim}"


@dataclass(frozen=True)
class FaultReport:
    fault: str
    sent: int
    completed: int
    failed: int
    continued: int
    tokens_lost: int
    tokens_duplicated: int
    blocks_held: int
    stall_s: float
    recover_s: float

    def line(self) -> str:
        return (
            f"{self.fault:<22} sent {self.sent:>3}  completed {self.completed:>3}  "
            f"failed {self.failed}  continued {self.continued:>2}  lost {self.tokens_lost}  "
            f"duplicated {self.tokens_duplicated}  blocks held {self.blocks_held}  "
            f"stall {self.stall_s:5.2f} s  recovered in {self.recover_s:5.1f} s"
        )


FAULTS = [
    pytest.param(Fault("coordinator-0", signal.SIGKILL, MID_STREAM_TOKENS), id="kill-coordinator"),
    # slow (22 s): the default suite loses a decode worker mid-stream where its host is cut off
    # (tests/test_network_partition.py's decode-host case)
    pytest.param(
        Fault("decode-0", signal.SIGKILL, MID_STREAM_TOKENS),
        id="kill-decode-worker",
        marks=pytest.mark.slow,
    ),
    *(
        pytest.param(fault, id=fault.name.replace(" ", "-").lower(), marks=pytest.mark.slow)
        for fault in [
            Fault("prefill-0", signal.SIGKILL, 0),
            Fault("coordinator-1", signal.SIGTERM, MID_STREAM_TOKENS),
            Fault("prefill-1", signal.SIGTERM, 0),
            Fault("decode-1", signal.SIGTERM, MID_STREAM_TOKENS),
            Fault("gateway", signal.SIGTERM, MID_STREAM_TOKENS),
            Fault("etcd", signal.SIGTERM, 0),  # nearly every token generated during the outage
        ]
    ),
]


@pytest.fixture(scope="module")
def served(ha_cluster: FaultCluster) -> FaultCluster:
    return ha_cluster


@pytest.fixture(scope="module")
def reference(served: FaultCluster) -> list[Stream]:
    """Every prompt's uninterrupted stream."""
    streams = asyncio.run(_stream_all(served.gateway.address, PROMPTS, lambda _: None))
    assert all(s.error is None and s.completion_tokens == MAX_TOKENS for s in streams), streams
    assert all(len(s.tokens) == MAX_TOKENS for s in streams)
    assert all(re.fullmatch(CONSTRAINED_CHARS + "*", s.text) for s in streams[1::2])
    return streams


async def _stream_all(
    url: str, prompts: list[str], watch: Callable[[list[Stream]], None], max_retries: int = 0
) -> list[Stream]:
    """Every prompt streamed at once through the gateway (greedy, ``ignore_eos``, the chosen
    tokens' logprobs; every other stream under ``CONSTRAINT``, so each fault also moves
    constrained requests: their matchers replay the tokens a resume or continuation carries);
    ``watch`` is called with the streams so far at every chunk."""
    sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=max_retries)
    model = (await sdk.models.list()).data[0].id
    streams = [Stream() for _ in prompts]

    async def one(index: int, prompt: str, stream: Stream) -> None:
        constrained = {"guided_regex": CONSTRAINT} if index % 2 else {}
        try:
            chunks = await sdk.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                logprobs=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True, **constrained},
            )
            async for chunk in chunks:
                if chunk.choices:
                    choice = chunk.choices[0]
                    if choice.logprobs is not None and choice.logprobs.tokens:
                        stream.tokens.extend(choice.logprobs.tokens)
                        stream.arrivals.append(time.monotonic())
                    stream.text += choice.text
                    stream.finish_reason = choice.finish_reason or stream.finish_reason
                if chunk.usage is not None:
                    stream.completion_tokens = chunk.usage.completion_tokens
                watch(streams)
        except openai.OpenAIError as error:
            stream.error = f"{type(error).__name__}: {error}"

    try:
        await asyncio.wait_for(
            asyncio.gather(
                *(one(i, p, s) for i, (p, s) in enumerate(zip(prompts, streams, strict=True)))
            ),
            600,
        )
    finally:
        await sdk.close()
    return streams


class _Striker:
    """Strikes ``fault`` once the streams reach its point (called at every chunk, on the
    event loop: the signal is sent at once; etcd is stopped on a thread)."""

    def __init__(self, cluster: FaultCluster, fault: Fault) -> None:
        self.cluster = cluster
        self.fault = fault
        self.struck_at: float | None = None
        self.struck = threading.Event()

    def __call__(self, streams: list[Stream]) -> None:
        if self.struck_at is not None:
            return
        counts = [len(s.tokens) for s in streams]
        ready = (
            max(counts) > 0
            if self.fault.strike_after == 0
            else (min(counts) >= self.fault.strike_after)
        )
        if not ready:
            return
        self.struck_at = time.monotonic()
        if self.fault.victim == "etcd":
            threading.Thread(target=self.cluster.etcd.stop, daemon=True).start()
        else:
            self.cluster.named(self.fault.victim).send(self.fault.signum)
        self.struck.set()


def _recover(cluster: FaultCluster, fault: Fault, striker: _Striker) -> float:
    """Bring the victim back as a supervisor would; seconds from the strike (from etcd's
    return for an outage) until the cluster is whole."""
    assert striker.struck.wait(300), f"{fault.name} never struck"
    assert striker.struck_at is not None
    if fault.victim == "etcd":
        time.sleep(max(0.0, striker.struck_at + ETCD_OUTAGE_S - time.monotonic()))
        cluster.etcd.start()
        back_at = time.monotonic()
        cluster.wait_whole()
        return time.monotonic() - back_at
    victim: RoleProcess = cluster.named(fault.victim)
    status = victim.wait_exit(DRAIN_EXIT_S)
    expected = -signal.SIGKILL if fault.signum == signal.SIGKILL else 0
    assert status == expected, f"{fault.victim} exited with {status}:\n{victim.tail()}"
    victim.start()
    cluster.wait_whole()
    return time.monotonic() - striker.struck_at


def _stall_s(streams: list[Stream], at: float) -> float:
    """The longest time any stream waited for its next tokens across ``at``."""
    stalls = [0.0]
    for stream in streams:
        before = [t for t in stream.arrivals if t <= at]
        after = [t for t in stream.arrivals if t > at]
        if before and after:
            stalls.append(after[0] - before[-1])
    return max(stalls)


def _lost_and_duplicated(expected: list[str], got: list[str]) -> tuple[int, int]:
    """Reference tokens missing from ``got`` and tokens ``got`` has beyond them."""
    lost = duplicated = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, expected, got).get_opcodes():
        if tag in ("delete", "replace"):
            lost += i2 - i1
        if tag in ("insert", "replace"):
            duplicated += j2 - j1
    return lost, duplicated


def _blocks_held(cluster: FaultCluster) -> int:
    loads = wait_until_idle(cluster.coordinator_addresses[0], len(cluster.workers))
    assert set(loads) == cluster.worker_ids
    return sum(load.num_used_blocks for load in loads.values())


async def _run_fault(cluster: FaultCluster, fault: Fault) -> tuple[list[Stream], float, float]:
    striker = _Striker(cluster, fault)
    recovery = asyncio.create_task(asyncio.to_thread(_recover, cluster, fault, striker))
    streams = await _stream_all(cluster.gateway.address, PROMPTS, striker)
    recover_s = await recovery
    assert striker.struck_at is not None
    return streams, striker.struck_at, recover_s


def _report(
    fault: str,
    streams: list[Stream],
    reference: list[Stream],
    continued: int,
    stall_s: float,
    recover_s: float,
    blocks_held: int,
) -> FaultReport:
    lost = duplicated = 0
    for stream, expected in zip(streams, reference, strict=True):
        stream_lost, stream_duplicated = _lost_and_duplicated(expected.tokens, stream.tokens)
        lost += stream_lost
        duplicated += stream_duplicated
    return FaultReport(
        fault=fault,
        sent=len(streams),
        completed=sum(s.error is None and s.finish_reason == "length" for s in streams),
        failed=sum(s.error is not None for s in streams),
        continued=continued,
        tokens_lost=lost,
        tokens_duplicated=duplicated,
        blocks_held=blocks_held,
        stall_s=stall_s,
        recover_s=recover_s,
    )


def _continued(before: dict[str, float], after: dict[str, float]) -> int:
    """Recoveries counted between two ``FaultCluster.recoveries()`` readings; a coordinator
    started in between counts from 0."""
    return int(sum(total - before.get(key, 0.0) for key, total in after.items()))


@pytest.mark.parametrize("fault", FAULTS)
def test_no_request_is_lost_to_a_fault(
    served: FaultCluster,
    reference: list[Stream],
    fault: Fault,
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = served.recoveries()
    streams, struck_at, recover_s = asyncio.run(_run_fault(served, fault))
    report = _report(
        fault.name,
        streams,
        reference,
        _continued(before, served.recoveries()),
        _stall_s(streams, struck_at),
        recover_s,
        _blocks_held(served),
    )
    with capsys.disabled():
        print(f"\n{report.line()}")
    assert [s.error for s in streams] == [None] * NUM_STREAMS
    assert (report.failed, report.tokens_lost, report.tokens_duplicated) == (0, 0, 0)
    assert report.completed == NUM_STREAMS and report.blocks_held == 0
    for stream, expected in zip(streams, reference, strict=True):
        assert (stream.text, stream.completion_tokens) == (expected.text, MAX_TOKENS)
    if fault.signum == signal.SIGKILL and fault.victim.startswith("coordinator"):
        assert report.continued > 0  # the dead coordinator's streams went on elsewhere


@pytest.mark.slow
def test_a_rolling_restart_of_every_process_loses_nothing(
    served: FaultCluster, reference: list[Stream], capsys: pytest.CaptureFixture[str]
) -> None:
    """Waves of ``NUM_STREAMS`` streams run back to back while every process in turn gets
    SIGTERM, drains, exits 0 and is started again (the next only once the cluster is whole).
    While the one gateway is down new connections are refused: the SDK retries those (its
    own back-off), as it does for any refused connection; a stream that started and broke is
    not retried and would count as failed."""
    done = threading.Event()
    waves: list[list[Stream]] = []

    async def load() -> None:
        while not done.is_set():
            waves.append(
                await _stream_all(served.gateway.address, PROMPTS, lambda _: None, max_retries=8)
            )

    def restart_each() -> None:
        try:
            for process in served.processes:
                process.send(signal.SIGTERM)
                status = process.wait_exit(DRAIN_EXIT_S)
                assert status == 0, f"{process.name} exited with {status}:\n{process.tail()}"
                process.start()
                served.wait_whole()
        finally:
            done.set()

    async def body() -> None:
        await asyncio.gather(load(), asyncio.to_thread(restart_each))

    asyncio.run(body())
    streams = [stream for wave in waves for stream in wave]
    with capsys.disabled():
        print(f"\nrolling restart: {len(waves)} waves, {len(streams)} streams")
    assert [s.error for s in streams] == [None] * len(streams)
    for wave in waves:
        for stream, expected in zip(wave, reference, strict=True):
            assert (stream.text, stream.tokens) == (expected.text, expected.tokens)
    assert _blocks_held(served) == 0


CONVERSATIONS = 4
TURN_TOKENS = 16
STRIKE_AT_CHUNK = 4
"""A mid-turn fault strikes once every second turn streamed this many chunks."""


def _sessions_homed_on(worker_id: str, others: list[str]) -> list[str]:
    """``CONVERSATIONS`` session ids whose home (``coordinator/router.py:session_home``)
    among the decode workers is ``worker_id``."""
    records = [_worker(name, Role.DECODE) for name in [worker_id, *others]]
    sessions = [f"chat-{i}" for i in range(1000)]
    homed = [s for s in sessions if session_home(s, records).worker_id == worker_id]
    return homed[:CONVERSATIONS]


async def _turns(
    url: str,
    sessions: list[str],
    between: Callable[[], None] = lambda: None,
    during: Callable[[], None] = lambda: None,
) -> list[list[str]]:
    """Two turns of each session's chat through the gateway, streamed (greedy,
    ``TURN_TOKENS`` each, the session in ``x-session-id``), the sessions side by side;
    ``between`` runs once every first turn has answered, ``during`` once every second turn
    has streamed ``STRIKE_AT_CHUNK`` chunks. Each session's replies."""
    sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model = (await sdk.models.list()).data[0].id
    chunks = [0] * len(sessions)
    struck = False

    async def turn(index: int, messages: list[dict[str, str]], second: bool) -> str:
        nonlocal struck
        stream = await sdk.chat.completions.create(
            model=model, messages=messages, max_tokens=TURN_TOKENS, temperature=0,  # type: ignore[arg-type]
            stream=True, extra_body={"ignore_eos": True},
            extra_headers={"x-session-id": sessions[index]},
        )  # fmt: skip
        text = ""
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
                chunks[index] += second
                if second and not struck and min(chunks) >= STRIKE_AT_CHUNK:
                    struck = True
                    during()
        return text

    histories = [
        [{"role": "user", "content": f"Tell me about the lighthouse keeper of island {i}."}]
        for i in range(len(sessions))
    ]
    try:
        firsts = await asyncio.gather(*(turn(i, h, False) for i, h in enumerate(histories)))
        between()
        for history, reply in zip(histories, firsts, strict=True):
            history += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "And what did the keeper do in winter?"},
            ]
        seconds = await asyncio.gather(*(turn(i, h, True) for i, h in enumerate(histories)))
    finally:
        await sdk.close()
    return [[first, second] for first, second in zip(firsts, seconds, strict=True)]


@pytest.mark.slow
@pytest.mark.parametrize("when", ["between", "during"])
def test_conversations_go_on_exactly_when_their_decode_worker_dies(
    served: FaultCluster, when: str
) -> None:
    """Conversations homed on decode-0 (session ids) run two turns uninterrupted, then again
    with decode-0 SIGKILLed between the turns (the history only the dead worker held is
    computed again elsewhere) or while the second turns stream (they resume on decode-1):
    every reply equals the uninterrupted one, token for token (float32), and nothing is
    left held."""
    sessions = _sessions_homed_on("decode-0", ["decode-1"])
    url = served.gateway.address
    reference = asyncio.run(_turns(url, sessions))
    victim = served.named("decode-0")
    decoders = {"decode-0", "decode-1"}
    before = worker_loads(served.coordinator_addresses[0], decoders)["decode-0"]

    def kill_the_home() -> None:
        victim.send(signal.SIGKILL)

    def check_then_kill() -> None:
        after = worker_loads(served.coordinator_addresses[0], decoders)["decode-0"]
        # every first turn decoded on its home, which holds its history now
        assert after.num_finished_requests - before.num_finished_requests == CONVERSATIONS
        kill_the_home()

    if when == "between":
        replies = asyncio.run(_turns(url, sessions, between=check_then_kill))
    else:
        replies = asyncio.run(_turns(url, sessions, during=kill_the_home))
    assert victim.wait_exit(30) == -signal.SIGKILL
    assert replies == reference
    assert all(len(turns[1]) > 0 for turns in replies)
    victim.start()
    served.wait_whole()
    assert _blocks_held(served) == 0
