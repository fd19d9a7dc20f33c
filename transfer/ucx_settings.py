"""How a process's UCX context is configured (``UcxSettings``), apart from the transport
(``ucx.py``) so that settings and launchers read it without importing torch or ucxx."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class UcxSettings:
    """How this process's UCX context is configured."""

    tls: str | None = None
    """UCX_TLS value, e.g. "sm,self" or "tcp"; None lets UCX choose."""
    error_handling: bool = False
    """Peer-failure detection on endpoints (forces failure-capable transports)."""
    progress_mode: str | None = None
    """How ucxx drives UCX's progress (``PROGRESS_MODES``): "thread" (ucxx's default: a
    thread that sleeps on the worker's events between requests), "thread-polling" (that
    thread spins: a core busy for the process's life, completions seen without a wake-up);
    None: ucxx's default, or ``UCXPY_PROGRESS_MODE`` from the environment."""

    def __post_init__(self) -> None:
        if self.progress_mode is not None and self.progress_mode not in PROGRESS_MODES:
            modes = ", ".join(PROGRESS_MODES)
            raise ValueError(f"UCX progress mode {self.progress_mode!r}: one of {modes}")


PROGRESS_MODES = ("thread", "thread-polling")
"""ucxx's progress modes that run off the event loop (its "blocking" and "polling" modes
progress on the loop, which the transport's Python futures do not use)."""
