"""Where a marker (a tag such as ``<tool_call>`` or ``</think>``, written by the model piece
by piece) may still begin: what a stream reading an answer as it comes must hold back."""

from __future__ import annotations


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker`` (0: none; never
    the whole marker, which a search finds)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
