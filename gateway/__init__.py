"""splitserve.gateway: OpenAI-compatible HTTP bridge (SSE) over the coordinator's gRPC API."""

GATEWAY_READY = "splitserve gateway ready"
"""What the gateway's ready line (``<what> at <scheme>://<host>:<port>``) announces; here,
not in ``main``, so that a launcher need not import the app to know it."""
