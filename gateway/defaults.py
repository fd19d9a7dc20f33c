"""The gateway's default bounds, apart from the code that enforces them, so that settings and
launchers (``gateway/settings.py``, ``frontend/settings.py``, ``launch/commands.py``) read them
without importing the HTTP stack: the GPU image serves without starlette."""

from __future__ import annotations

DEFAULT_MAX_BODY_BYTES = 16 << 20
"""16 MiB: far more than a full context of text, well under gRPC's 64 MiB message limit."""

CLIENT_STALL_TIMEOUT_S = 30.0
"""How long an SSE frame may wait for a client that reads nothing (the coordinator's own
``--client-stall-timeout`` for the gRPC clients it streams to)."""

STORED_RESPONSES_TTL_S = 24 * 3600.0
"""How long a stored response is kept."""

STORED_RESPONSES_MEMORY_BYTES = 512 << 20
"""What the in-memory response store holds at most."""
