"""One OpenTelemetry trace per request across every process (``common/tracing.py``), received
by a real OTLP/gRPC receiver: an in-test ``TraceService`` (opentelemetry-proto) that the
cluster's processes export to through the standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``.

A ``splitserve up`` cluster (coordinator, a prefill and a decode worker with simulated engines,
the gateway; prompts up to 32 tokens computed on the decode worker) serves two chats through
the gateway, each with a client ``traceparent``: a long prompt (its prompt on the prefill
worker, its KV pushed over UCX) streamed, and a short one (on the decode worker) whole. Each
gets its trace: the client's trace id on every span of every process, the trace's spans
connected (each span's parent is the client's span or another span of the trace), the
request id on each span, the response's ``traceparent`` in the trace, and the spans of
exactly the path it took. Slow: a decode worker SIGKILLed mid-stream (the request resumed on
another, in its trace, the coordinator span recording the resume) and a coordinator SIGKILLed
mid-stream (each of its streams continued through the other coordinator, whose span joins the
client's trace and records the continuation).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import KeyValue

from splitserve.client import AsyncClient, Chunk, Sampling
from tests.cluster import child_pid, cluster, metric_total, worker_loads
from tests.etcd import free_port

pytestmark = pytest.mark.timeout(300)

CLIENT_TRACE_IDS = ("4bf92f3577b34da6a3ce929d0e0e4736", "0af7651916cd43dd8448eb211c80319c")
CLIENT_SPAN_ID = "00f067aa0ba902b7"
LOCAL_PREFILL_MAX_TOKENS = 32
RESUMED_TRACE_ID = "5b8efff798038103d269b633813fc60c"
RESUMED_TOKENS = 48
CONTINUED_TRACE_IDS = tuple(f"{i:032x}" for i in range(0xA1, 0xA7))


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, object]
    events: tuple[tuple[str, dict[str, object]], ...] = ()


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span exported to it."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        received = []
        for resource_spans in request.resource_spans:
            service = next(
                a.value.string_value
                for a in resource_spans.resource.attributes
                if a.key == "service.name"
            )
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            service,
                            span.name,
                            span.trace_id.hex(),
                            span.span_id.hex(),
                            span.parent_span_id.hex(),
                            _attributes(span.attributes),
                            tuple((e.name, _attributes(e.attributes)) for e in span.events),
                        )
                    )
        with self._lock:
            self.spans += received
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [span for span in self.spans if span.trace_id == trace_id]


def _attributes(attributes: Sequence[KeyValue]) -> dict[str, object]:
    return {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in attributes}


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, int]]:
    server = grpc.server(futures.ThreadPoolExecutor(4))
    servicer = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, port
    finally:
        server.stop(None)


async def _chats(url: str) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        long = "Tell me everything about the lighthouse keeper and the sea. " * 12
        requests = [(long, True, "traced-remote"), ("Hi", False, "traced-local")]
        responses = []
        for (content, stream, request_id), trace_id in zip(requests, CLIENT_TRACE_IDS, strict=True):
            headers = {
                "traceparent": f"00-{trace_id}-{CLIENT_SPAN_ID}-01",
                "x-request-id": request_id,
            }
            body = {
                "model": model,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": 6,
                "stream": stream,
            }
            async with client.stream(
                "POST", "/v1/chat/completions", json=body, headers=headers
            ) as response:
                await response.aread()
            responses.append(response)
        return responses


def _wait_for(receiver: Receiver, trace_id: str, names: set[str]) -> list[ReceivedSpan]:
    deadline = time.monotonic() + 20
    while not names <= {span.name for span in receiver.trace(trace_id)}:
        assert time.monotonic() < deadline, [s.name for s in receiver.trace(trace_id)]
        time.sleep(0.1)
    time.sleep(0.5)  # a span that should not be there would have come with the others
    return receiver.trace(trace_id)


@pytest.mark.parametrize("layout", ["merged", pytest.param("apart", marks=pytest.mark.slow)])
def test_each_request_is_one_connected_trace_across_every_process(
    receiver: tuple[Receiver, int], layout: str
) -> None:
    """``merged``: up's default, the gateway and the coordinator one ``splitserve frontend``
    process (one service); ``apart``: each its own."""
    gateway_service = "splitserve-frontend" if layout == "merged" else "splitserve-gateway"
    coordinator_service = "splitserve-frontend" if layout == "merged" else "splitserve-coordinator"
    up_flags = ("--apart",) if layout == "apart" else ()
    spans_in, port = receiver
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "SPLITSERVE_LOCAL_PREFILL_MAX_TOKENS": str(LOCAL_PREFILL_MAX_TOKENS),
    }
    lines: dict[str, str] = {}
    with cluster(1, 1, "--engine=sim", ready_lines=lines, env=env, up_flags=up_flags):
        responses = asyncio.run(_chats(lines["splitserve gateway ready"]))
        paths = {
            CLIENT_TRACE_IDS[0]: {
                "gateway /v1/chat/completions", "coordinator generate", "prefill",
                "prefill compute", "kv push", "decode",
            },
            CLIENT_TRACE_IDS[1]: {"gateway /v1/chat/completions", "coordinator generate", "decode"},
        }  # fmt: skip
        traces = {
            trace_id: _wait_for(spans_in, trace_id, names) for trace_id, names in paths.items()
        }

    for response, (trace_id, spans) in zip(responses, traces.items(), strict=True):
        assert response.status_code == 200
        returned = response.headers["traceparent"].split("-")
        assert returned[1] == trace_id  # the client's trace, continued and returned
        by_id = {span.span_id: span for span in spans}
        assert returned[2] in by_id and by_id[returned[2]].service == gateway_service
        names = {span.name for span in spans}
        # exactly the path it took beyond the gateway (which has FastAPI's HTTP spans too)
        ours = paths[trace_id]
        assert ours <= names
        beyond = {span.name for span in spans if span.service != gateway_service}
        in_front = {"gateway /v1/chat/completions"}
        if layout == "merged":
            in_front.add("coordinator generate")
        assert beyond == ours - in_front
        for span in spans:
            assert span.parent_span_id in by_id or span.parent_span_id == CLIENT_SPAN_ID, span
            if span.name in ours:
                assert span.attributes["splitserve.request_id"] == response.headers["x-request-id"]
        services = {span.name: span.service for span in spans}
        assert services["coordinator generate"] == coordinator_service
        assert services["decode"] == "splitserve-decode"
        (root,) = [span for span in spans if span.parent_span_id == CLIENT_SPAN_ID]
        assert root.service == gateway_service
        (gateway,) = [span for span in spans if span.name == "gateway /v1/chat/completions"]
        (coordinator,) = [span for span in spans if span.name == "coordinator generate"]
        assert coordinator.parent_span_id == gateway.span_id
        assert all(
            by_id[span.parent_span_id].name == "coordinator generate"
            for span in spans
            if span.name in ("prefill", "decode")
        )
        where = "remote" if "prefill" in services else "local"
        assert coordinator.attributes["splitserve.placement.where"] == where
        assert ("prefill" in names) == (trace_id == CLIENT_TRACE_IDS[0])
    remote = {span.name: span for span in traces[CLIENT_TRACE_IDS[0]]}
    assert remote["prefill"].service == "splitserve-prefill"
    assert int(remote["kv push"].attributes["splitserve.kv_bytes"]) > 0
    assert remote["decode"].attributes["splitserve.remote_prefill"] is True
    assert int(remote["decode"].attributes["splitserve.generated_tokens"]) == 6


async def _stream_and_kill_its_decode_worker(
    address: str, up: subprocess.Popen[str]
) -> tuple[list[int], str]:
    """One traced stream straight to the coordinator; once it has a few tokens, SIGKILL the
    decode worker running it. Its tokens and the worker killed."""
    sampling = Sampling(max_tokens=RESUMED_TOKENS, temperature=0.0, ignore_eos=True)
    traceparent = f"00-{RESUMED_TRACE_ID}-{CLIENT_SPAN_ID}-01"
    tokens: list[int] = []
    victim = ""
    async with AsyncClient(address) as client:
        stream = client.stream("Count the waves:", sampling=sampling, traceparent=traceparent)
        async for item in stream:
            if isinstance(item, Chunk):
                tokens += item.token_ids
                if not victim and len(tokens) >= 3:
                    loads = await asyncio.to_thread(worker_loads, address)
                    (victim,) = [n for n, load in loads.items() if load.num_running_requests]
                    os.kill(child_pid(up.pid, f"--worker-id={victim}"), signal.SIGKILL)
    return tokens, victim


@pytest.mark.slow  # a cluster of its own; the default suite keeps the remote and local paths
def test_a_resumed_request_stays_in_its_trace(receiver: tuple[Receiver, int]) -> None:
    """A decode worker killed mid-stream: the request goes on on the other one, in the same
    trace, under the same coordinator span, which records the resume."""
    spans_in, port = receiver
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{port}",
           "OTEL_BSP_SCHEDULE_DELAY": "100"}  # fmt: skip
    processes: list[subprocess.Popen[str]] = []
    with cluster(1, 2, "--engine=sim", processes=processes, env=env) as address:
        tokens, victim = asyncio.run(_stream_and_kill_its_decode_worker(address, processes[0]))
        spans = _wait_for(spans_in, RESUMED_TRACE_ID, {"coordinator generate", "decode"})
    assert len(tokens) == RESUMED_TOKENS and victim
    (coordinator,) = [span for span in spans if span.name == "coordinator generate"]
    assert coordinator.parent_span_id == CLIENT_SPAN_ID
    assert ("recovery", {"kind": "decode_resume"}) in coordinator.events
    # the survivor's span (the victim's died with it, unexported), under the same parent
    decodes = [span for span in spans if span.name == "decode"]
    assert decodes and all(span.parent_span_id == coordinator.span_id for span in decodes)
    assert any(int(span.attributes["splitserve.generated_tokens"]) > 0 for span in decodes)


def _coordinator_serving(up: subprocess.Popen[str], address: str) -> int:
    """The pid of ``up``'s child that listens on ``address``'s port (from /proc: the
    listening socket's inode among the child's open files)."""
    port = int(address.rsplit(":", 1)[1])
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    for pid in Path(f"/proc/{up.pid}/task/{up.pid}/children").read_text().split():
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd) in inodes:
                    return int(pid)
    raise LookupError(f"no child of up listens on {address}")


async def _streams_through_a_dying_coordinator(
    target: str, up: subprocess.Popen[str], metrics_urls: list[str]
) -> None:
    """Traced streams (``CONTINUED_TRACE_IDS``) given both coordinators; once each has a
    token, the coordinator running the most of them (``metrics_urls``, in the target's
    order) is SIGKILLed: its streams go on through the other."""
    sampling = Sampling(max_tokens=RESUMED_TOKENS, temperature=0.0, ignore_eos=True)
    async with AsyncClient(target) as client:

        async def one(trace_id: str) -> None:
            traceparent = f"00-{trace_id}-{CLIENT_SPAN_ID}-01"
            stream = client.stream("Count the waves:", sampling=sampling, traceparent=traceparent)
            got = 0
            async for item in stream:
                if isinstance(item, Chunk):
                    got += len(item.token_ids)
                    started[trace_id].set()
            assert got == RESUMED_TOKENS

        started = {trace_id: asyncio.Event() for trace_id in CONTINUED_TRACE_IDS}
        tasks = [asyncio.create_task(one(trace_id)) for trace_id in CONTINUED_TRACE_IDS]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), 60)
        running = [
            await asyncio.to_thread(metric_total, url, "splitserve_num_requests_in_flight")
            for url in metrics_urls
        ]
        victim = target.split(",")[running.index(max(running))]
        os.kill(_coordinator_serving(up, victim), signal.SIGKILL)
        await asyncio.gather(*tasks)


@pytest.mark.slow  # a cluster of its own; the default suite keeps the remote and local paths
def test_a_stream_continued_through_another_coordinator_stays_in_its_trace(
    receiver: tuple[Receiver, int],
) -> None:
    """A coordinator killed mid-stream: each of its streams is continued through the other
    coordinator, whose span joins the client's trace and records the continuation."""
    spans_in, port = receiver
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{port}",
           "OTEL_BSP_SCHEDULE_DELAY": "100"}  # fmt: skip
    processes: list[subprocess.Popen[str]] = []
    base = free_port()  # coordinator i's metrics at base + i (up's rule)
    metrics_urls = [f"http://127.0.0.1:{base + i}/metrics" for i in range(2)]
    flags = ("--coordinators=2", f"--metrics-port-base={base}")
    with cluster(1, 1, "--engine=sim", up_flags=flags, processes=processes, env=env) as target:
        asyncio.run(_streams_through_a_dying_coordinator(target, processes[0], metrics_urls))
        traces = [
            _wait_for(spans_in, trace_id, {"coordinator generate", "decode"})
            for trace_id in CONTINUED_TRACE_IDS
        ]
    continued = 0
    for spans in traces:
        coordinators = [span for span in spans if span.name == "coordinator generate"]
        # the dead coordinator's span died with it, unexported: the survivor's is the one
        (coordinator,) = coordinators
        assert coordinator.parent_span_id == CLIENT_SPAN_ID
        decodes = [span for span in spans if span.name == "decode"]
        assert any(span.parent_span_id == coordinator.span_id for span in decodes)
        others = [span for span in decodes if span.parent_span_id != coordinator.span_id]
        if ("recovery", {"kind": "coordinator_continuation"}) in coordinator.events:
            continued += 1
            # the decode worker's span of the stream before the kill: under the dead
            # coordinator's span, which never arrived
            assert {span.parent_span_id for span in others}.isdisjoint(
                span.span_id for span in spans
            )
        else:
            assert not others
    assert continued >= 1  # some streams were on the killed coordinator


def test_without_an_endpoint_nothing_is_traced() -> None:
    from splitserve.common import tracing

    environ = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    assert tracing.configure_tracing("coordinator", None, environ) is False
    span = tracing.start_span("coordinator generate", "r")
    assert not span.is_recording() and tracing.traceparent_of(span) == ""
