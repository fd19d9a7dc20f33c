"""Prometheus metrics shared by every role (torch-free): buckets, request-level latencies.

Names are prefixed ``splitserve_`` and mean what vLLM's metric of the same suffix means, with
the same histogram buckets, so existing dashboards carry over by renaming ``vllm:`` to
``splitserve_``. Labels are low-cardinality only: ``model_name`` and ``role`` (gateway,
coordinator, prefill, decode), plus a small fixed set where noted (``finished_reason``,
``direction``, ``stage``, ``reason``).

``RequestMetrics`` is what an entry point (gateway, coordinator) records per request:
TTFT, inter-token latency, per-request time per output token, end-to-end latency, finished
requests by reason, prompt and generation length. Engine and disaggregation figures live in
``splitserve.worker.metrics``; ``serve_metrics`` exposes a registry over HTTP.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Iterator, Sequence

from opentelemetry.trace import Span, StatusCode
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from splitserve.common.tracing import NO_SPAN

disable_created_metrics()  # no ``*_created`` series: they double the output and nobody reads them

# Bucket boundaries equal to vLLM's defaults for the same quantities.
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
KV_TRANSFER_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0, 60.0,
)  # fmt: skip
"""Seconds for one request's KV handoff: sub-millisecond (small prompt, GPU link) to a minute."""


def request_token_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_model_len`` (vLLM's token-count buckets)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


FINISHED_REASONS = ("stop", "length", "abort", "error")


class LoopHistogram(Collector):
    """A Prometheus histogram observed from one thread (an entry point's event loop), with no
    lock: ``observe`` is a bisect and two additions (prometheus_client's ``Histogram`` takes a
    lock per bucket and per sum, about 3 us, once per streamed token per role). A scrape on
    the metrics thread reads the counts as they are: a bucket may lead the sum by an
    observation, which Prometheus' histograms tolerate. Exposes the same series as
    ``Histogram`` (``_bucket`` with ``le``, ``_count``, ``_sum``)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = list(labelnames)
        self._bounds = [float(bound) for bound in buckets]
        self._children: dict[tuple[str, ...], LoopHistogramChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> LoopHistogramChild:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = LoopHistogramChild(self._bounds)
        return child

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)
        for values, child in list(self._children.items()):
            counts = list(child.counts)  # per bucket (the last: above every bound), not cumulative
            total = 0
            cumulative = []
            for bound, count in zip([*self._bounds, math.inf], counts, strict=True):
                total += count
                cumulative.append((floatToGoString(bound), total))
            family.add_metric(list(values), cumulative, child.sum)
        yield family


class LoopHistogramChild:
    """One label set's buckets (``LoopHistogram``)."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: list[float]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        """Observations per bucket, each counted once: ``counts[i]`` those in (bound i-1,
        bound i], the last those above every bound."""
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self._bounds, value)] += 1
        self.sum += value


class RequestMetricFamilies:
    """The request-level metric families of one registry, labelled by model and role; bind
    them to one (``for_model``) per model an entry point serves (a gateway in front of
    several models binds each). ``max_model_len`` sets the token-count buckets (the largest
    context the entry point expects)."""

    def __init__(self, registry: CollectorRegistry, max_model_len: int = 8192) -> None:
        labels = ["model_name", "role"]
        token_buckets = request_token_buckets(max_model_len)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> LoopHistogram:
            return LoopHistogram(name, doc, labels, buckets, registry)

        self.ttft = histogram(
            "splitserve_time_to_first_token_seconds",
            "Time to first token.",
            TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self.itl = histogram(
            "splitserve_inter_token_latency_seconds",
            "Time between consecutive output tokens.",
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self.tpot = histogram(
            "splitserve_request_time_per_output_token_seconds",
            "Per request: decode time divided by output tokens after the first.",
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "splitserve_e2e_request_latency_seconds",
            "End-to-end request latency.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prompt_tokens = histogram(
            "splitserve_request_prompt_tokens", "Prompt length of finished requests.", token_buckets
        )
        self.generation_tokens = histogram(
            "splitserve_request_generation_tokens",
            "Generated tokens of finished requests.",
            token_buckets,
        )
        self.success = Counter(
            "splitserve_request_success",
            "Finished requests by finish reason (error: ended by a failure).",
            [*labels, "finished_reason"],
            registry=registry,
        )
        self.in_flight = Gauge(
            "splitserve_num_requests_in_flight",
            "Requests received and not finished at this entry point.",
            labels,
            registry=registry,
        )

    def for_model(self, model_name: str, role: str) -> RequestMetrics:
        return RequestMetrics(self, model_name, role)


class RequestMetrics:
    """Request-level latencies of one model at one entry point, recorded from its event
    loop's thread only (the histograms are ``LoopHistogram``s).

    Semantics (as vLLM): TTFT = first token streamed - request received; inter-token latency
    = time between consecutive streamed token chunks, one observation per token after the
    first (a chunk of k tokens after a gap g is k observations of g / k); time per output
    token = (last token - first token) / (generated - 1) once per request; e2e = finish -
    received.
    """

    def __init__(self, families: RequestMetricFamilies, model_name: str, role: str) -> None:
        values = (model_name, role)
        self.ttft = families.ttft.labels(*values)
        self.itl = families.itl.labels(*values)
        self.tpot = families.tpot.labels(*values)
        self.e2e = families.e2e.labels(*values)
        self.prompt_tokens = families.prompt_tokens.labels(*values)
        self.generation_tokens = families.generation_tokens.labels(*values)
        self.success = {
            reason: families.success.labels(*values, reason) for reason in FINISHED_REASONS
        }
        self.in_flight = families.in_flight.labels(*values)

    def start(self, span: Span = NO_SPAN) -> RequestTimer:
        return RequestTimer(self, span)


class RequestTimer:
    """Timestamps of one request; call ``tokens`` for every streamed chunk, then ``finish``.
    Every token after the first gets one inter-token observation, whichever chunk it came in
    (a chunk's tokens share its gap; those with the first token have none).
    ``span``: the request's span here (``common/tracing.py``), ended by ``finish``."""

    def __init__(self, metrics: RequestMetrics, span: Span = NO_SPAN) -> None:
        self._metrics = metrics
        self._span = span
        self.received = time.monotonic()
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.num_tokens = 0
        self._finished = False
        metrics.in_flight.inc()

    def tokens(self, count: int) -> None:
        if count <= 0:
            return
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
            self._metrics.ttft.observe(now - self.received)
            for _ in range(count - 1):  # tokens that came with the first: no time between
                self._metrics.itl.observe(0.0)
        elif self.last_token is not None:
            gap = (now - self.last_token) / count
            for _ in range(count):
                self._metrics.itl.observe(gap)
        self.num_tokens += count
        self.last_token = now

    def finish(
        self,
        reason: str,
        prompt_tokens: int | None = None,
        generation_tokens: int | None = None,
    ) -> None:
        """Record the end once (later calls are ignored); ``reason`` in FINISHED_REASONS.

        Token counts are observed only when known (a request that ended by a failure or a
        disconnect is counted by reason, not in the length histograms)."""
        if self._finished:
            return
        self._finished = True
        if self._span.is_recording():
            self._span.set_attribute("splitserve.finish_reason", reason)
            self._span.set_attribute("splitserve.completion_tokens", self.num_tokens)
            if reason == "error":
                self._span.set_status(StatusCode.ERROR)
            self._span.end()
        metrics = self._metrics
        metrics.in_flight.dec()
        metrics.success[reason if reason in metrics.success else "error"].inc()
        if reason == "error":
            return
        metrics.e2e.observe(time.monotonic() - self.received)
        if prompt_tokens is not None:
            metrics.prompt_tokens.observe(prompt_tokens)
        if generation_tokens is not None:
            metrics.generation_tokens.observe(generation_tokens)
        if self.first_token is not None and self.last_token is not None and self.num_tokens > 1:
            metrics.tpot.observe((self.last_token - self.first_token) / (self.num_tokens - 1))


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> int:
    """Serve ``registry`` at ``http://host:port/metrics`` on a daemon thread; returns the port
    (a free one when ``port`` is 0). Exits the process with a clear message when the port is
    taken (another cluster on this host: give it other ports or 0)."""
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as error:
        raise SystemExit(
            f"cannot serve metrics on {host}:{port} ({error.strerror}); pass another "
            "--metrics-port (0 picks a free one, -1 turns metrics off)"
        ) from error
    return server.server_port
