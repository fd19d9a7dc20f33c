"""What a finished request's flow did, written onto its coordinator span
(``common/tracing.py``): where its prompt was placed and why, the stages of its path, the
recoveries and stalls it survived, its token counts. Called once, as the request ends."""

from __future__ import annotations

from opentelemetry.trace import Span

from splitserve.coordinator.flow import RequestFlow


def trace_flow(span: Span, flow: RequestFlow) -> None:
    if not span.is_recording():
        return
    span.set_attribute("splitserve.prompt_tokens", len(flow.prompt_token_ids))
    span.set_attribute("splitserve.completion_tokens", flow.num_completion_tokens)
    span.set_attribute("splitserve.state", flow.state.value)
    if flow.placement is not None:
        placement = flow.placement.placement
        span.set_attribute("splitserve.placement.where", placement.where)
        span.set_attribute("splitserve.placement.reason", placement.reason.value)
    for stage, seconds in flow.stage_seconds:
        span.add_event(f"stage {stage}", {"seconds": seconds})
    for kind in flow.recoveries:
        span.add_event("recovery", {"kind": kind})
    for role, reason in flow.stalls:
        span.add_event("stall", {"role": role, "reason": reason})
