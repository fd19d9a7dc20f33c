"""Property-based fuzzing of splitserve's two public APIs against a real cluster.

One ``splitserve up`` cluster (coordinator, 1 prefill + 1 decode worker, HTTP gateway) serves
both parts. Its workers run with ``--max-model-len=128`` so that a request without
``max_tokens`` (it fills the context) stays short; what asks for more is refused, which is
one more path fuzzed.

1. HTTP gateway: schemathesis reads the gateway's own ``/openapi.json`` and generates
   requests for every operation it lists: schema-valid ("positive") and schema-violating
   ("negative") ones, and for the POST routes "anchored" ones (valid, naming the served
   model, often with a usable prompt and an ``x-request-id`` header) so that more of them
   reach generation. Contract: no response is 5xx; every 4xx carries OpenAI's error body
   ``{"error": {"message", "type", "param", "code"}}``; each response conforms to the schema
   (documented status code, content type and body); an SSE stream (``stream: true``) has
   JSON events, ends with ``data: [DONE]`` and carries no server-side error event.
2. Coordinator gRPC (public port): hypothesis builds ``GenerateRequest`` messages with any
   field values (any valid text, token ids out of the vocabulary and of int32's ends, floats
   with NaN and infinities, huge counts and seeds, empty stop strings, continuations) and
   ``Abort`` with any request id. Contract: each call ends OK or with a client-error status
   (``CLIENT_ERRORS``), never INTERNAL, UNKNOWN, UNAVAILABLE or a timeout; an error inside a
   stream has such a code too; an OK stream ends with its completion message.

After each part a normal request is served (the ``openai`` SDK, the gRPC client) and every
worker's KV pool is whole. Each part prints what it sent: requests per operation and kind,
histograms of status codes and of the fields refusals blamed, and its slowest call.

Marked slow (``make test-slow``); about 3 minutes on 2 cores. Each part has a time budget
(``Budget``): past it, the remaining examples are skipped and the count printed.
``SPLITSERVE_FUZZ_SCALE=5`` multiplies example counts, budgets and the timeout for a longer
hunt. A failure is shrunk by hypothesis and shown with its input (a curl command for HTTP,
the message for gRPC).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from requests.structures import CaseInsensitiveDict
from schemathesis import Case, GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from splitserve.client import Client, Sampling
from splitserve.proto.splitserve.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from splitserve.proto.status import PARAM_METADATA_KEY
from tests.cluster import assert_all_free, cluster, wait_until_idle

SCALE = float(os.environ.get("SPLITSERVE_FUZZ_SCALE", "1"))
"""Multiplies every example count and time budget below (a longer hunt: e.g. 5)."""
pytestmark = [pytest.mark.slow, pytest.mark.timeout(int(420 * SCALE))]

T = TypeVar("T")

MAX_MODEL_LEN = 128
"""The workers' context window: keeps every generation short."""
HTTP_EXAMPLES = {
    kind: round(count * SCALE)
    for kind, count in {"positive": 40, "negative": 40, "anchored": 60}.items()
}
"""Examples per operation and kind (an operation without body or parameters has only one)."""
HTTP_BUDGET_S = 150 * SCALE
GRPC_EXAMPLES = round(100 * SCALE)
"""Batches of 1 to 3 concurrent ``Generate`` calls."""
ABORT_EXAMPLES = round(30 * SCALE)
GRPC_BUDGET_S = 130 * SCALE
REQUEST_TIMEOUT_S = 60.0
"""Far more than any request here needs: running into it is a hang."""
CLIENT_ERRORS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
    }
)
"""The gRPC statuses that blame the request (HTTP's 4xx); anything else but OK is a bug."""
CLIENT_ERROR_TYPES = frozenset({"invalid_request_error", "rate_limit_error"})
"""OpenAI error types of the gateway's 4xx; an SSE error event of another type is a 5xx."""
CLIENT_ERROR_CODES = frozenset({
    "invalid_request_error", "rate_limit_exceeded", "not_found", "request_too_large",
})  # fmt: skip
"""The codes of a Responses stream's ``error`` event for a client's error (its 4xx's code,
else its type)."""
STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}
SCHEMA_CHECKS = [status_code_conformance, content_type_conformance, response_schema_conformance]


@dataclass(frozen=True)
class Served:
    coordinator: str
    """The coordinator's public gRPC address."""
    url: str
    """The gateway's base URL."""
    model: str
    vocab_size: int


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    lines: dict[str, str] = {}
    with cluster(1, 1, f"--max-model-len={MAX_MODEL_LEN}", ready_lines=lines) as coordinator:
        url = lines["splitserve gateway ready"]
        with Client(coordinator, timeout_s=30) as client:
            client.wait_ready(timeout_s=60)
            info = client.model_info()
        assert info.max_model_len == MAX_MODEL_LEN
        yield Served(coordinator, url, info.model, info.vocab_size)


@dataclass
class Budget:
    """A part's time budget. Once it is spent the remaining examples are skipped (and
    counted), so a slow or busy machine shortens the fuzzing instead of timing the test out;
    never while a failure is being shrunk (a skipped replay would look flaky)."""

    seconds: float
    started: float = field(default_factory=time.monotonic)
    skipped: int = 0
    failing: bool = False

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def __str__(self) -> str:
        skipped = f", {self.skipped} examples skipped: time budget spent" if self.skipped else ""
        return f"{self.elapsed():.0f} s of {self.seconds:.0f}{skipped}"


def _fuzz(
    strategy: st.SearchStrategy[T], examples: int, budget: Budget, check: Callable[[T], None]
) -> None:
    """Run ``check`` on ``examples`` values of ``strategy`` within ``budget`` (hypothesis: a
    failure is shrunk and reported with its smallest input). No example database: nothing
    is written."""

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def run(value: T) -> None:
        if budget.elapsed() > budget.seconds and not budget.failing:
            budget.skipped += 1
            return
        try:
            check(value)
        except BaseException:
            budget.failing = True
            raise

    run()


def _histogram(counts: Counter[Any]) -> str:
    return "\n".join(f"  {count:5d}  {key}" for key, count in sorted(counts.items(), key=str))


def _assert_pools_whole(served: Served) -> None:
    assert_all_free(wait_until_idle(served.coordinator, 2), 2)


# ---------------------------------------------------------------------------------------------
# Part 1: the HTTP gateway, driven by schemathesis from its OpenAPI schema


@dataclass
class HttpTally:
    """Responses seen, by (operation, kind of input, status code)."""

    statuses: Counter[tuple[str, str, int]] = field(default_factory=Counter)
    refused: Counter[tuple[str, str]] = field(default_factory=Counter)
    """4xx by (operation, the field their ``param`` blamed: list indices as ``*``; "-": none)."""
    slowest_s: float = 0.0

    def by_operation(self) -> Counter[tuple[str, str]]:
        counts: Counter[tuple[str, str]] = Counter()
        for (label, kind, _), count in self.statuses.items():
            counts[(label, kind)] += count
        return counts


def _anchored(cases: st.SearchStrategy[Case], model: str, path: str) -> st.SearchStrategy[Case]:
    """Schema-valid cases steered toward generation: the served model's name; for
    completions, often a short text or token-id prompt, or token ids up to a few past the
    context's end; for responses, often a short text input; often an ``x-request-id``
    (printable latin-1, up to 300 characters: over 256 is a 400; leading whitespace is not
    sent)."""
    prompts = st.one_of(
        st.text(min_size=1, max_size=60),
        st.lists(st.integers(0, 999), min_size=1, max_size=24),
        st.lists(st.integers(0, 999), min_size=MAX_MODEL_LEN - 10, max_size=MAX_MODEL_LEN + 2),
    )
    request_ids = st.text(
        st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_categories=("Cc",)),
        max_size=300,
    ).map(str.lstrip)  # HTTP drops leading whitespace (requests refuses to send it)

    @st.composite
    def steer(draw: st.DrawFn) -> Case:
        case = draw(cases)
        if isinstance(case.body, dict):
            body = {**case.body, "model": model}
            if path == "/v1/completions" and draw(st.booleans()):
                body["prompt"] = draw(prompts)
            if path == "/v1/responses" and draw(st.booleans()):
                body["input"] = draw(st.text(min_size=1, max_size=60))
            case.body = body
        if draw(st.booleans()):
            headers = CaseInsensitiveDict(case.headers or {})
            headers["x-request-id"] = draw(request_ids)
            case.headers = headers
        return case

    return steer()


def _operation_strategies(
    operation: schemathesis.APIOperation, model: str
) -> list[tuple[str, st.SearchStrategy[Case]]]:
    """(kind, strategy) pairs for one operation: positive; for one with a body or parameters
    outside its path also negative (a path segment of text, such as a response id, has no
    invalid value for schemathesis to make); for a POST also anchored."""
    positive = operation.as_strategy(generation_mode=GenerationMode.POSITIVE)
    kinds = [("positive", positive)]
    if operation.body or any(p.location != "path" for p in operation.iter_parameters()):
        kinds.append(("negative", operation.as_strategy(generation_mode=GenerationMode.NEGATIVE)))
    if operation.method == "post":
        kinds.append(("anchored", _anchored(positive, model, operation.path)))
    return kinds


def _assert_openai_error(response: schemathesis.Response) -> str | None:
    """A 4xx body: exactly ``{"error": {"message", "type", "param", "code"}}``, message and
    type non-empty strings, param and code strings or null. Returns the param."""
    assert response.headers.get("content-type", [""])[0].startswith("application/json")
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error
    return error["param"]


def _assert_typed_event_stream(text: str) -> None:
    """A Responses API SSE body: ``event: <type>`` / ``data: {json}`` pairs whose data names
    the same type, numbered from 0, ending with the response's last event; an ``error``
    event only of a client-error kind."""
    events = [event for event in text.split("\n\n") if event.strip()]
    assert events, "an empty stream"
    for number, event in enumerate(events):
        name, data = event.split("\n", 1)
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}" and payload["sequence_number"] == number
        if payload["type"] == "error":
            assert payload["code"] in CLIENT_ERROR_CODES, f"server error mid-stream: {payload}"
    last = json.loads(events[-1].split("\n", 1)[1].removeprefix("data: "))["type"]
    assert last in ("response.completed", "response.incomplete", "response.failed"), last


def _assert_event_stream(text: str) -> None:
    """An SSE body: ``data:`` events, each JSON but the final ``[DONE]``; no error event of a
    server-side type (a failure after the first token is sent as an event, not a status)."""
    events = [event for event in text.split("\n\n") if event.strip()]
    assert events and events[-1] == "data: [DONE]", f"the stream did not end with [DONE]: {text!r}"
    for event in events[:-1]:
        assert event.startswith("data: "), event
        payload = json.loads(event.removeprefix("data: "))
        error = payload.get("error")
        if error is not None:
            assert error.get("type") in CLIENT_ERROR_TYPES, f"server error mid-stream: {error}"


def _check_http(case: Case, url: str, kind: str, tally: HttpTally) -> None:
    note(case.as_curl_command(base_url=url))
    response = case.call(base_url=url, timeout=REQUEST_TIMEOUT_S)
    status = response.status_code
    tally.statuses[(case.operation.label, kind, status)] += 1
    tally.slowest_s = max(tally.slowest_s, response.elapsed)
    assert status < 500, f"{status}: {response.text[:2000]}"
    if 400 <= status < 500:
        param = _assert_openai_error(response)
        # messages.3.role -> messages.*.role
        field_path = re.sub(r"\.\d+(?=\.|$)", ".*", param or "-")
        tally.refused[(case.operation.label, field_path)] += 1
    content_type = response.headers.get("content-type", [""])[0]
    if status == 200 and content_type.startswith("text/event-stream"):
        assert not response.stream_cut_short, "the stream ran past the request timeout"
        if case.operation.path == "/v1/responses":
            _assert_typed_event_stream(response.text)
        else:
            _assert_event_stream(response.text)
    case.validate_response(response, checks=SCHEMA_CHECKS)


def test_gateway_openapi_fuzz(served: Served) -> None:
    config = schemathesis.Config.from_dict({"max-stream-events": 10_000})
    schema = schemathesis.openapi.from_url(f"{served.url}/openapi.json", config=config)
    operations = [result.ok() for result in schema.get_all_operations()]
    labels = {operation.label for operation in operations}
    assert {"GET /v1/models", "POST /v1/completions", "POST /v1/chat/completions"} <= labels
    tally = HttpTally()
    budget = Budget(HTTP_BUDGET_S)
    for operation in operations:
        for kind, strategy in _operation_strategies(operation, served.model):

            def check(case: Case, kind: str = kind) -> None:
                _check_http(case, served.url, kind, tally)

            _fuzz(strategy, HTTP_EXAMPLES[kind], budget, check)
    print(
        f"\n[fuzz http] {sum(tally.statuses.values())} requests in {budget}"
        f"; slowest {tally.slowest_s:.1f} s"
        f"\nper operation and kind:\n{_histogram(tally.by_operation())}"
        f"\nstatus codes:\n{_histogram(tally.statuses)}"
        f"\n4xx by field blamed:\n{_histogram(tally.refused)}"
    )
    generated = [key for key in tally.statuses if key[0].startswith("POST") and key[2] == 200]
    assert generated, "no fuzzed request was served"

    sdk = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    model = sdk.models.list().data[0].id
    normal = sdk.completions.create(
        model=model, prompt="Hello", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert normal.usage.completion_tokens == 4 and normal.choices[0].finish_reason == "length"
    assert httpx.get(f"{served.url}/health", timeout=10).status_code == 200
    _assert_pools_whole(served)


# ---------------------------------------------------------------------------------------------
# Part 2: the coordinator's public gRPC API, driven by hypothesis-built messages

INT32 = st.integers(-(2**31), 2**31 - 1)
UINT32 = st.integers(0, 2**32 - 1)
UINT64 = st.integers(0, 2**64 - 1)
FLOAT32 = st.floats(width=32)
"""Any float32: NaN, infinities, subnormals, the largest finite ones."""
CHARACTERS = st.characters(exclude_categories=("Cs",))
"""Any character protobuf can carry (a lone surrogate is not valid UTF-8)."""
TEXT = st.text(CHARACTERS, max_size=80)


@dataclass(frozen=True)
class _Ranges:
    """Where a request's values come from: a "tame" request draws every field from its usual
    range (most such requests are served); a "wild" one also from the whole range of the
    field's wire type (most are refused, the point being how)."""

    wild: bool
    vocab_size: int

    def of(
        self, usual: st.SearchStrategy[T], anything: st.SearchStrategy[Any]
    ) -> st.SearchStrategy[Any]:
        return st.one_of(usual, anything) if self.wild else usual

    def token_ids(self, min_size: int = 0) -> st.SearchStrategy[list[int]]:
        ids = self.of(st.integers(0, self.vocab_size - 1), INT32)
        return st.lists(ids, min_size=min_size, max_size=40)


@st.composite
def _sampling(draw: st.DrawFn, ranges: _Ranges) -> common_pb2.SamplingParams:
    """Sampling params, each optional field unset or drawn from ``ranges``. ``max_tokens`` is
    mostly 1..8, sometimes unset (fill the context); when wild also 0 or anything in uint32;
    ``min_tokens`` (tame) at most ``max_tokens``."""
    stop = draw(st.lists(ranges.of(TEXT.filter(bool), TEXT), max_size=3))
    stop_ids = draw(ranges.token_ids().map(lambda ids: ids[:3]))
    message = common_pb2.SamplingParams(
        stop=stop, stop_token_ids=stop_ids, ignore_eos=draw(st.booleans())
    )
    small = st.integers(1, 8)
    max_tokens = draw(st.one_of(small, small, small, st.none(), ranges.of(small, UINT32)))
    ceiling = 8 if max_tokens is None else max_tokens

    def pick(usual: st.SearchStrategy[T], anything: st.SearchStrategy[Any]) -> Any:
        return draw(st.one_of(st.none(), ranges.of(usual, anything)))

    values: dict[str, object | None] = {
        "max_tokens": max_tokens,
        "temperature": pick(st.floats(0, 2), FLOAT32),
        "top_p": pick(st.floats(0.05, 1), FLOAT32),
        "top_k": pick(st.integers(-1, 100), INT32),
        "min_p": pick(st.floats(0, 1), FLOAT32),
        "seed": pick(st.integers(0, 2**63 - 1), UINT64),
        "repetition_penalty": pick(st.floats(0.5, 2), FLOAT32),
        "frequency_penalty": pick(st.floats(-2, 2), FLOAT32),
        "presence_penalty": pick(st.floats(-2, 2), FLOAT32),
        "min_tokens": pick(st.integers(0, min(ceiling, 8)), UINT32),
        "logprobs": pick(st.integers(0, 20), UINT32),
        "skip_special_tokens": pick(st.booleans(), st.booleans()),
    }
    for name, value in values.items():
        if value is not None:
            setattr(message, name, value)
    return message


@st.composite
def _generate_requests(draw: st.DrawFn, vocab_size: int) -> coordinator_pb2.GenerateRequest:
    """A ``GenerateRequest``, tame or wild (``_Ranges``): a request id (empty, any text, or
    up to 2000 characters when wild); a text, chat or token-id prompt, or one of valid token
    ids within a few tokens of the context's end (when wild also an empty, missing or
    overlong prompt, chat roles of any text); sampling params (when wild sometimes none: then
    the context is filled); sometimes a continuation."""
    ranges = _Ranges(draw(st.booleans()), vocab_size)
    request = coordinator_pb2.GenerateRequest(
        request_id=draw(ranges.of(st.one_of(st.just(""), TEXT), st.text(CHARACTERS, max_size=2000)))
    )
    kinds = ["text", "chat", "token_ids", "context edge"]
    kinds += ["long text", "none"] if ranges.wild else []
    kind = draw(st.sampled_from(kinds))
    least = 0 if ranges.wild else 1
    if kind == "text":
        request.text = draw(st.text(CHARACTERS, min_size=least, max_size=80))
    elif kind == "long text":
        request.text = draw(st.text(CHARACTERS, min_size=300, max_size=3000))
    elif kind == "chat":
        roles = ranges.of(st.sampled_from(["system", "user", "assistant"]), TEXT)
        messages = draw(st.lists(st.tuples(roles, TEXT), min_size=least, max_size=4))
        request.chat.SetInParent()  # present even when empty
        for role, content in messages:
            request.chat.messages.add(role=role, content=content)
    elif kind == "token_ids":
        request.token_ids.SetInParent()
        request.token_ids.ids.extend(draw(ranges.token_ids(min_size=least)))
    elif kind == "context edge":
        edge = st.lists(
            st.integers(0, vocab_size - 1),
            min_size=MAX_MODEL_LEN - 10,
            max_size=MAX_MODEL_LEN + (2 if ranges.wild else -1),
        )
        request.token_ids.ids.extend(draw(edge))
    if not ranges.wild or draw(st.integers(0, 4)) > 0:
        request.sampling.CopyFrom(draw(_sampling(ranges)))
    if draw(st.integers(0, 4)) == 0:
        request.continue_after.ids.extend(draw(ranges.token_ids()))
    return request


@st.composite
def _batches(draw: st.DrawFn, vocab_size: int) -> list[coordinator_pb2.GenerateRequest]:
    """1 to 3 requests sent at once; sometimes all under the first one's non-empty request
    id (all but one may be refused: that id is already running)."""
    requests = draw(st.lists(_generate_requests(vocab_size), min_size=1, max_size=3))
    if len(requests) > 1 and requests[0].request_id and draw(st.booleans()):
        for request in requests[1:]:
            request.request_id = requests[0].request_id
    return requests


@dataclass
class GrpcTally:
    """Final statuses by RPC and code name, and error codes seen inside streams."""

    statuses: Counter[tuple[str, str]] = field(default_factory=Counter)
    stream_errors: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    """Generate calls refused, by the field blamed ("-": none)."""
    slowest_s: float = 0.0


@dataclass(frozen=True)
class GenerateOutcome:
    """How one ``Generate`` call ended: its status and what it streamed."""

    code: grpc.StatusCode
    details: str
    param: str
    """The field a refusal blames (trailing metadata), or ""."""
    responses: tuple[coordinator_pb2.GenerateResponse, ...]
    seconds: float


def _generate(
    stub: coordinator_pb2_grpc.CoordinatorStub, request: coordinator_pb2.GenerateRequest
) -> GenerateOutcome:
    """Call ``Generate`` and read its stream to the end (runs on a worker thread)."""
    started = time.monotonic()
    responses: list[coordinator_pb2.GenerateResponse] = []
    try:
        for response in stub.Generate(request, timeout=REQUEST_TIMEOUT_S):
            responses.append(response)
    except grpc.RpcError as error:
        param = dict(error.trailing_metadata() or ()).get(PARAM_METADATA_KEY, "")
        seconds = time.monotonic() - started
        return GenerateOutcome(
            error.code(), error.details() or "", param, tuple(responses), seconds
        )
    seconds = time.monotonic() - started
    return GenerateOutcome(grpc.StatusCode.OK, "", "", tuple(responses), seconds)


def _check_generate(
    request: coordinator_pb2.GenerateRequest, outcome: GenerateOutcome, tally: GrpcTally
) -> None:
    """The contract for one call: OK or a client error, in-stream errors client errors too;
    an OK stream ends with its completion (or error) message, and without a continuation its
    usage counts a prompt and at most ``max_tokens`` completion tokens."""
    code = outcome.code
    tally.statuses[("Generate", code.name)] += 1
    tally.refused[outcome.param or "-"] += code is not grpc.StatusCode.OK
    tally.slowest_s = max(tally.slowest_s, outcome.seconds)
    assert code is grpc.StatusCode.OK or code in CLIENT_ERRORS, f"{code.name}: {outcome.details}"
    for response in outcome.responses:
        if response.WhichOneof("payload") == "error":
            error_code = STATUS_BY_NUMBER.get(response.error.code)
            tally.stream_errors[error_code.name if error_code else str(response.error.code)] += 1
            assert error_code in CLIENT_ERRORS, f"error in the stream: {response.error}"
    if code is not grpc.StatusCode.OK:
        return
    assert outcome.responses, "an OK stream without a message"
    last = outcome.responses[-1]
    assert last.WhichOneof("payload") in ("completion", "error"), last
    if last.WhichOneof("payload") == "completion" and not request.continue_after.ids:
        assert last.usage.prompt_tokens > 0, last
        if request.sampling.HasField("max_tokens"):
            assert last.usage.completion_tokens <= request.sampling.max_tokens, last


def _check_batch(
    stub: coordinator_pb2_grpc.CoordinatorStub,
    pool: ThreadPoolExecutor,
    requests: list[coordinator_pb2.GenerateRequest],
    tally: GrpcTally,
) -> None:
    for number, request in enumerate(requests):
        note(f"GenerateRequest {number}:\n{request}")
    outcomes = list(pool.map(lambda request: _generate(stub, request), requests))
    for number, (request, outcome) in enumerate(zip(requests, outcomes, strict=True)):
        note(f"request {number} ended {outcome.code.name}: {outcome.details}")
        _check_generate(request, outcome, tally)


def _check_abort(
    stub: coordinator_pb2_grpc.CoordinatorStub, request_id: str, tally: GrpcTally
) -> None:
    note(f"Abort request_id={request_id!r}")
    try:
        reply = stub.Abort(coordinator_pb2.AbortRequest(request_id=request_id), timeout=10)
        code = grpc.StatusCode.OK
    except grpc.RpcError as error:
        code = error.code()
        reply = None
    tally.statuses[("Abort", code.name)] += 1
    assert code is grpc.StatusCode.OK or code in CLIENT_ERRORS, code
    assert reply is None or not reply.aborted  # nothing of that id runs


def test_grpc_generate_fuzz(served: Served) -> None:
    tally = GrpcTally()
    budget = Budget(GRPC_BUDGET_S)
    with (
        contextlib.closing(grpc.insecure_channel(served.coordinator)) as channel,
        ThreadPoolExecutor(max_workers=3) as pool,
    ):
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        _fuzz(
            st.one_of(TEXT, st.text(CHARACTERS, min_size=200, max_size=5000)),
            ABORT_EXAMPLES,
            budget,
            lambda request_id: _check_abort(stub, request_id, tally),
        )
        _fuzz(
            _batches(served.vocab_size),
            GRPC_EXAMPLES,
            budget,
            lambda requests: _check_batch(stub, pool, requests, tally),
        )
    print(
        f"\n[fuzz grpc] {sum(tally.statuses.values())} calls in {budget}"
        f"; slowest Generate {tally.slowest_s:.1f} s"
        f"\nstatus codes:\n{_histogram(tally.statuses)}"
        f"\nGenerate refusals by field:\n{_histogram(+tally.refused)}"
        f"\nerrors inside streams:\n{_histogram(tally.stream_errors) or '  none'}"
    )
    assert tally.statuses[("Generate", "OK")] > 0, "no fuzzed request was served"

    with Client(served.coordinator, timeout_s=60) as client:
        normal = client.generate("Hello", sampling=Sampling(max_tokens=4, ignore_eos=True))
    assert normal.usage.completion_tokens == 4 and normal.finish_reason == "length"
    _assert_pools_whole(served)
