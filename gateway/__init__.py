"""splitserve.gateway: OpenAI-compatible HTTP bridge (SSE) over the coordinator's gRPC API."""
