"""The ``metadata`` a response or a conversation keeps, as OpenAI bounds it: at most 16 pairs
of strings, keys at most 64 characters, values at most 512 (a 400 naming the key past them)."""

from __future__ import annotations

from typing import Any

from splitserve.gateway.errors import invalid

MAX_METADATA_PAIRS = 16
MAX_KEY_CHARS = 64
MAX_VALUE_CHARS = 512


def checked_metadata(metadata: dict[str, Any] | None) -> dict[str, str]:
    """``metadata`` within the limits (module docstring); 400 naming ``metadata``."""
    metadata = metadata or {}
    if len(metadata) > MAX_METADATA_PAIRS:
        raise invalid(f"metadata holds at most {MAX_METADATA_PAIRS} pairs", "metadata")
    for key, value in metadata.items():
        if not isinstance(value, str) or len(key) > MAX_KEY_CHARS or len(value) > MAX_VALUE_CHARS:
            raise invalid(
                f"metadata's keys are strings of at most {MAX_KEY_CHARS} characters and its "
                f"values strings of at most {MAX_VALUE_CHARS}",
                f"metadata.{key}",
            )
    return dict(metadata)
