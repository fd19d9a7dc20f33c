"""End to end with real processes on loopback: real gRPC, real UCX, the default model.

float32 workers are batch invariant, so a disaggregated cluster (1 prefill + 1 decode worker,
KV pushed layer by layer over UCX) must produce exactly the tokens of the colocated in-process
float32 engine (prefill and decode in one engine). Every block on every worker must be free
afterwards, as the workers themselves report it. Through the cluster's gateway, ``n > 1`` is
one prompt forked (``tests/test_fork.py:assert_n_choices_fork``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.common.grammar import GrammarSpec
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.checkpoint import LoadedCheckpoint
from splitserve.engine.device import cpu_bf16_refusal
from splitserve.engine.llm import LLM
from splitserve.proto import convert
from splitserve.proto.splitserve.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.cluster import (
    CREDENTIAL,
    ProcessSpec,
    assert_all_free,
    cluster,
    routable_members,
    running_together,
    transfer_figures,
    wait_until_idle,
)
from tests.conftest import make_llm
from tests.test_beam_search import assert_beam_search_served
from tests.test_fork import assert_n_choices_fork

# every pull of cached KV (the reverse transfer) that saves a block: the conversation below
# pulls one
WORKER_FLAGS = (
    "--dtype=float32",
    "--num-blocks=400",
    "--threads=1",
    "--pull-cached-kv-min-blocks=1",
)
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three colors:",
    "Once upon a time, in a land far away, " * 8,
    "Explain photosynthesis in one sentence.",
    "1, 2, 3, 4,",
    "Translate 'good morning' into Spanish:",
]
pytestmark = pytest.mark.timeout(600)


def _greedy(max_tokens: int, **extra: object) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, **extra
    )


async def _generate(
    stub: coordinator_pb2_grpc.CoordinatorStub, request: coordinator_pb2.GenerateRequest
) -> tuple[list[int], coordinator_pb2.GenerateResponse]:
    tokens: list[int] = []
    last = None
    async for response in stub.Generate(request, timeout=300):
        if response.HasField("chunk"):
            tokens.extend(response.chunk.token_ids)
        last = response
    assert last is not None and last.HasField("completion"), last
    return tokens, last


async def _generate_all(address: str, requests: list[coordinator_pb2.GenerateRequest]) -> list:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        return await asyncio.gather(*(_generate(stub, r) for r in requests))


def _references(
    checkpoint: LoadedCheckpoint, params: SamplingParams
) -> tuple[LLM, list[coordinator_pb2.GenerateRequest], list[list[int]], list[int], list[int]]:
    """The in-process float32 engine, the requests the cluster gets and what each must
    return (``PROMPTS`` greedy, two logit-biased, two constrained, in that order), and a
    conversation's next turn with its expected output. Two batches: the second's requests
    depend on the first's outputs."""
    llm = make_llm(checkpoint)
    requests = [
        coordinator_pb2.GenerateRequest(request_id=f"p{i}", text=text, sampling=_greedy(24))
        for i, text in enumerate(PROMPTS)
    ]
    expected = [list(output.token_ids) for output in llm.generate(PROMPTS, params)]
    # logit_bias on the prefill worker's first token and every decode step: it bans each
    # prompt's first greedy token and favours the next other one
    biases = [
        {tokens[0]: -100.0, next(t for t in tokens if t != tokens[0]): 2.5}
        for tokens in expected[:2]
    ]
    requests += [
        coordinator_pb2.GenerateRequest(
            request_id=f"b{i}", text=text, sampling=_greedy(24, logit_bias=bias)
        )
        for i, (text, bias) in enumerate(zip(PROMPTS, biases, strict=False))
    ]
    # structured outputs: the prefill worker's first token obeys the grammar, the decode
    # worker's matcher starts from it (carried with the KV, not sampled again)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    grammars = [GrammarSpec.json_schema(schema), GrammarSpec("regex", "[0-9]{2}-[a-z]{3,8}")]
    constrained = [replace(params, max_tokens=48, min_tokens=0, grammar=spec) for spec in grammars]
    requests += [
        coordinator_pb2.GenerateRequest(
            request_id=f"g{i}", text=PROMPTS[i], sampling=convert.sampling_to_proto(sampling)
        )
        for i, sampling in enumerate(constrained)
    ]
    # a conversation's next turn: turn 1 (PROMPTS[4]), its reply, a new message; the decode
    # worker decoded turn 1, so only the blocks after what it holds travel
    turn2 = llm.encode_prompt(PROMPTS[4]) + expected[4] + llm.encode_prompt(" And then?")
    second = llm.generate(
        [*PROMPTS[:2], *PROMPTS[: len(grammars)], turn2],
        [*(replace(params, logit_bias=bias) for bias in biases), *constrained, params],
    )
    biased_expected = [list(output.token_ids) for output in second[:2]]
    assert all(b != e for b, e in zip(biased_expected, expected, strict=False))
    expected += biased_expected
    expected += [list(output.token_ids) for output in second[2:4]]
    assert json.loads(llm.tokenizer.decode(expected[-2]))["name"]  # finished, and parses
    return llm, requests, expected, turn2, list(second[4].token_ids)


def test_disaggregated_equals_colocated_and_frees_every_block(
    default_checkpoint_fp32: LoadedCheckpoint,
) -> None:
    params = SamplingParams(max_tokens=24, min_tokens=24, temperature=0.0)
    lines: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        # the cluster starts (its processes load the model) while the references compute
        with ThreadPoolExecutor(1) as starter:
            started = starter.submit(
                stack.enter_context, cluster(1, 1, *WORKER_FLAGS, ready_lines=lines)
            )
            llm, requests, expected, turn2, turn2_expected = _references(
                default_checkpoint_fp32, params
            )
            disaggregated = started.result()
        # up says ready only once the coordinator routes to every worker it started: a
        # request sent right away may use the prefill worker
        assert routable_members(disaggregated) == {"prefill-0", "decode-1"}
        results = asyncio.run(_generate_all(disaggregated, requests))
        assert [tokens for tokens, _ in results] == expected
        for (tokens, last), prompt in zip(results, PROMPTS + PROMPTS[:2], strict=False):
            assert len(tokens) == 24 and last.usage.completion_tokens == 24, prompt
            assert last.completion.finish_reason == common_pb2.FINISH_REASON_LENGTH

        loads = wait_until_idle(disaggregated, 2)
        assert_all_free(loads, 2)
        prefill = loads["prefill-0"]
        assert prefill.num_finished_requests >= len(PROMPTS)  # the prompts went through it

        before = transfer_figures(lines["decode metrics"])
        pulled_before = transfer_figures(lines["prefill metrics"])
        conversation = coordinator_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=turn2), sampling=_greedy(24)
        )
        ((tokens, last),) = asyncio.run(_generate_all(disaggregated, [conversation]))
        assert tokens == turn2_expected
        turn1_tokens = len(llm.encode_prompt(PROMPTS[4]))
        held = (turn1_tokens + 24 - 1) // 16  # its last token: no KV
        after = transfer_figures(lines["decode metrics"])
        assert after.reused_blocks - before.reused_blocks == held
        received = after.landed_bytes - before.landed_bytes
        layout_bytes = 2 * 30 * 3 * 64 * 4 * 16  # K and V x layers x KV heads x dim x fp32 x 16
        assert received == layout_bytes * (-(-len(turn2) // 16) - held)
        # the reverse transfer: the prefill worker held turn 1's full blocks; the reply's it
        # received from the decode worker, and computed only the tokens after them
        pulled = transfer_figures(lines["prefill metrics"])
        assert pulled.pulled_blocks - pulled_before.pulled_blocks == held - turn1_tokens // 16 > 0
        assert pulled.landed_bytes - pulled_before.landed_bytes == layout_bytes * (
            held - turn1_tokens // 16
        )
        assert last.usage.cached_tokens == held * 16
        # the same prompt's logprobs: computed whole on the prefill worker (nothing pulled,
        # nothing from its cache), carried to the decode worker with the first token, equal
        # to the in-process engine's over gRPC and through the gateway (lm-eval's payload)
        _assert_served_prompt_logprobs(disaggregated, lines["splitserve gateway ready"], llm, turn2)
        reversed_again = transfer_figures(lines["prefill metrics"])
        assert reversed_again.pulled_blocks == pulled.pulled_blocks

        streams = [
            coordinator_pb2.GenerateRequest(
                text=f"Request {i}: tell me about the number {i * 7}.",
                sampling=common_pb2.SamplingParams(max_tokens=12, ignore_eos=True),
            )
            for i in range(32)
        ]
        results = asyncio.run(_generate_all(disaggregated, streams))
        assert all(len(tokens) == 12 for tokens, _ in results)
        assert all(
            last.completion.finish_reason == common_pb2.FINISH_REASON_LENGTH for _, last in results
        )
        assert_all_free(wait_until_idle(disaggregated, 2), 2)

        asyncio.run(_cancel_mid_stream(disaggregated))
        asyncio.run(_bad_requests_do_not_disturb_others(disaggregated))
        assert_all_free(wait_until_idle(disaggregated, 2), 2)
        # n > 1 through the gateway: one prompt forked (tests/test_fork.py)
        workers = [lines["prefill metrics"], lines["decode metrics"]]
        assert_n_choices_fork(lines["splitserve gateway ready"], workers, disaggregated)
        assert_all_free(wait_until_idle(disaggregated, 2), 2)
        # beam search through the gateway: the in-process engine's beams (tests/test_beam_search.py)
        assert_beam_search_served(lines["splitserve gateway ready"], llm)
        assert_all_free(wait_until_idle(disaggregated, 2), 2)


def _assert_served_prompt_logprobs(
    address: str, gateway_url: str, llm: LLM, prompt: list[int]
) -> None:
    """``prompt_logprobs`` over gRPC and ``echo`` with ``logprobs`` over HTTP (the payload
    lm-evaluation-harness sends for a loglikelihood) equal the in-process float32 engine's
    records, the prompt's whole (no cached token)."""
    (reference,) = llm.generate(
        [prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    )
    expected = reference.prompt_logprobs
    assert [record.token_id for record in expected] == prompt[1:]
    request = coordinator_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=prompt), sampling=_greedy(1, prompt_logprobs=2)
    )

    async def served() -> tuple[list[common_pb2.TokenLogprob], coordinator_pb2.PromptToken, int]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            records, first, cached = [], None, -1
            async for response in stub.Generate(request, timeout=300):
                if response.HasField("chunk") and response.chunk.prompt_logprobs:
                    records += response.chunk.prompt_logprobs
                    first = response.chunk.prompt_first_token
                cached = response.usage.cached_tokens
            return records, first, cached

    records, first, cached = asyncio.run(served())
    assert cached == 0
    assert first.token_id == prompt[0] and first.text == llm.tokenizer.decode(
        prompt[:1], skip_special_tokens=False
    )
    assert [r.token_id for r in records] == prompt[1:]
    assert [r.rank for r in records] == [r.rank for r in expected]
    for got, want in zip(records, expected, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t.token_id for t in got.top] == [t for t, _ in want.top]
        assert got.text == llm.tokenizer.decode([want.token_id], skip_special_tokens=False)

    sdk = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0)
    model = sdk.models.list().data[0].id
    completion = sdk.completions.create(
        model=model, prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0.0
    )
    logprobs = completion.choices[0].logprobs
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert len(logprobs.tokens) == len(prompt) + 1  # the prompt's, then the generated one
    assert logprobs.token_logprobs[1 : len(prompt)] == pytest.approx(
        [record.logprob for record in expected], abs=1e-4
    )
    assert completion.choices[0].text.startswith("".join(logprobs.tokens[: len(prompt)]))


async def _cancel_mid_stream(address: str) -> None:
    """A client that goes away mid-stream: its request ends on every worker."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        call = stub.Generate(
            coordinator_pb2.GenerateRequest(
                text="Count from one to one thousand:",
                sampling=common_pb2.SamplingParams(max_tokens=2000, ignore_eos=True),
            ),
            timeout=120,
        )
        received = 0
        async for response in call:
            received += len(response.chunk.token_ids)
            if received >= 5:
                call.cancel()
                break
    assert received >= 5


async def _bad_requests_do_not_disturb_others(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        healthy = asyncio.create_task(
            _generate(
                stub,
                coordinator_pb2.GenerateRequest(text="Hello there", sampling=_greedy(16)),
            )
        )
        bad = [
            coordinator_pb2.GenerateRequest(text="", sampling=_greedy(4)),
            coordinator_pb2.GenerateRequest(text="hi", sampling=_greedy(10**6)),
            coordinator_pb2.GenerateRequest(
                token_ids=common_pb2.TokenIds(ids=[10**7]), sampling=_greedy(4)
            ),
            coordinator_pb2.GenerateRequest(
                text="hi", sampling=common_pb2.SamplingParams(temperature=-1.0)
            ),
        ]
        for request in bad:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await _generate(stub, request)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value
            assert error.value.details()
        # 40 MB of text: refused by its lower bound on tokens, without tokenizing it (which
        # would take the coordinator's event loop for a quarter of a minute)
        huge = coordinator_pb2.GenerateRequest(text="word " * (8 << 20), sampling=_greedy(4))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await _generate(stub, huge)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value
        assert "the prompt has at least" in error.value.details()
        tokens, last = await healthy
        assert len(tokens) == 16


@pytest.mark.slow  # 7 s: two workers started for a refusal at the handshake
def test_mismatched_kv_layout_is_refused_at_handshake() -> None:
    decode_argv = ["splitserve.decode.main", "--port=0", *WORKER_FLAGS, "--block-size=16"]
    prefill_argv = ["splitserve.prefill.main", "--port=0", "--num-blocks=100", "--threads=1"]
    bf16 = cpu_bf16_refusal() is None  # elsewhere a bf16 worker is refused at start
    prefill_argv += ["--block-size=32", *(["--dtype=bfloat16"] if bf16 else [])]
    announced: dict[str, str] = {}
    specs = [
        ProcessSpec(decode_argv, "splitserve decode ready at", announced),
        ProcessSpec(prefill_argv, "splitserve prefill ready at"),
    ]
    with running_together(specs) as (decode_address, prefill_address):
        metrics_url = announced["decode metrics"]
        details = asyncio.run(_try_mismatched_push(decode_address, prefill_address, metrics_url))
        assert "incompatible" in details.lower()
        assert "block_size: local=16 peer=32" in details
        assert not bf16 or "dtype: local='float32' peer='bfloat16'" in details


def _kv_cache_usage(metrics_url: str) -> float:
    """The decode worker's own ``splitserve_kv_cache_usage_perc`` (used blocks / all)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "splitserve_kv_cache_usage_perc":
            return family.samples[0].value
    raise AssertionError(f"no kv_cache_usage_perc at {metrics_url}")


async def _try_mismatched_push(decode_address: str, prefill_address: str, metrics_url: str) -> str:
    async with (
        grpc.aio.insecure_channel(decode_address) as decode_channel,
        grpc.aio.insecure_channel(prefill_address) as prefill_channel,
    ):
        decode = worker_pb2_grpc.DecodeWorkerStub(decode_channel)
        prefill = worker_pb2_grpc.PrefillWorkerStub(prefill_channel)
        prompt = list(range(1000, 1040))
        call = decode.Generate(
            worker_pb2.WorkerGenerateRequest(
                request_id="r", prompt_token_ids=prompt, sampling=_greedy(4), remote_prefill=True
            ),
            timeout=60,
            metadata=CREDENTIAL.metadata,
        )
        first = await call.read()
        assert first.HasField("reservation")
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await prefill.Prefill(
                worker_pb2.PrefillRequest(
                    request_id="r",
                    prompt_token_ids=prompt,
                    sampling=_greedy(4),
                    target=first.reservation,
                ),
                timeout=60,
                metadata=CREDENTIAL.metadata,
            )
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        call.cancel()  # the reservation is released
        deadline = time.monotonic() + 10
        while usage := _kv_cache_usage(metrics_url):  # no block used any more
            assert time.monotonic() < deadline, usage
            await asyncio.sleep(0.1)
        return error.value.details()
