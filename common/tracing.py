"""OpenTelemetry tracing: one trace per request across every process it touches.

Off unless configured: ``configure_tracing`` installs an SDK tracer provider exporting spans
over OTLP/gRPC only when the process has an endpoint (``--otlp-traces-endpoint``, or the
standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``; the
exporter reads the other ``OTEL_*`` variables: headers, TLS, timeouts). Otherwise every span
is the API's non-recording span and costs a function call.

Propagation is W3C trace context, carried explicitly as a ``traceparent`` string: in the
gateway's HTTP headers (honoured from the client and returned to it), then in the
``traceparent`` field of each request message (``GenerateRequest``, ``WorkerGenerateRequest``,
``PrefillRequest``), so it survives the multiplexed calls where many requests share one gRPC
call and its metadata. Spans are started and ended explicitly (never made current: the
request's code runs in async generators whose context a span must not leak into), each with
the request id as ``splitserve.request_id``.

Span names: ``gateway <route>`` (server), ``coordinator generate`` (with events admitted,
placed, resumed and the placement's attributes), ``prefill`` with its children ``prefill
compute`` and ``kv push`` (bytes sent), ``decode`` (events reserved, first token; tokens
generated). A resume or continuation shows as another ``decode`` (or ``prefill``) span under
the same coordinator span, or another coordinator span of the same trace.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from splitserve.common.settings import add_settings_args, setting

logger = logging.getLogger(__name__)

REQUEST_ID_ATTRIBUTE = "splitserve.request_id"
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
"""The standard variables naming where spans go; either turns tracing on."""
TRACER_NAME = "splitserve"
NO_SPAN: Span = trace.INVALID_SPAN
"""The span of untraced work: records nothing, its children record nothing."""

_propagator = TraceContextTextMapPropagator()
_enabled = False


@dataclass(frozen=True)
class TracingSettings:
    """Where spans go (a settings group: ``common/settings.py``)."""

    otlp_traces_endpoint: str | None = setting(
        None,
        "export OpenTelemetry spans over OTLP/gRPC to this endpoint (e.g. "
        "http://collector:4317); default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
        "OTEL_EXPORTER_OTLP_ENDPOINT if set, else no tracing",
    )


def add_tracing_args(parser: argparse._ActionsContainer) -> None:
    """``--otlp-traces-endpoint`` (env twin ``SPLITSERVE_OTLP_TRACES_ENDPOINT``)."""
    add_settings_args(parser, TracingSettings)


def configure_tracing(
    role: str, endpoint: str | None = None, environ: Mapping[str, str] = os.environ
) -> bool:
    """Export this process's spans (service name ``OTEL_SERVICE_NAME`` or
    ``splitserve-<role>``) when an endpoint is given or set in the environment; whether
    tracing is on. Call once, at start."""
    global _enabled
    endpoint = endpoint or next((environ[v] for v in ENDPOINT_VARIABLES if environ.get(v)), None)
    if not endpoint:
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    service = environ.get("OTEL_SERVICE_NAME") or f"splitserve-{role}"
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    _enabled = True
    logger.info("tracing: spans of %s go to %s over OTLP/gRPC", service, endpoint)
    return True


def shutdown_tracing() -> None:
    """Export what is buffered (at exit; a no-op when tracing is off)."""
    provider = trace.get_tracer_provider()
    shutdown = getattr(provider, "shutdown", None)
    if shutdown is not None:
        shutdown()


def tracing_enabled() -> bool:
    return _enabled


def _parent_context(traceparent: str) -> Context | None:
    if not traceparent:
        return None
    return _propagator.extract({"traceparent": traceparent})


def start_span(
    name: str,
    request_id: str,
    traceparent: str = "",
    parent: Span | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
) -> Span:
    """A started span (the caller ends it) under ``parent``, else under the remote span a
    ``traceparent`` names, else a new trace's root; ``NO_SPAN`` when tracing is off."""
    if not _enabled:
        return NO_SPAN
    context = trace.set_span_in_context(parent) if parent is not None else None
    if context is None:
        context = _parent_context(traceparent)
    tracer = trace.get_tracer(TRACER_NAME)
    return tracer.start_span(
        name, context=context, kind=kind, attributes={REQUEST_ID_ATTRIBUTE: request_id}
    )


def active_span() -> Span | None:
    """The span a framework made current around this code (FastAPI's HTTP server span
    traces the gateway's requests where a tracer provider is set), else None."""
    span = trace.get_current_span()
    return span if span.get_span_context().is_valid else None


def traceparent_of(span: Span) -> str:
    """The W3C ``traceparent`` naming ``span`` as the parent of remote work ("" when the span
    records nothing: a next hop that traces starts a trace of its own)."""
    if not span.get_span_context().is_valid:
        return ""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, trace.set_span_in_context(span))
    return carrier.get("traceparent", "")
