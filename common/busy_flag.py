"""Whether a worker's engine has work, published to the workers beside it on one machine.

Co-located workers lend each other their cores (``engine/step_threads.py``): a worker whose
engine sits idle lets a neighbour run its steps with more threads. Each lending worker owns a
``BusyFlag`` file, one byte in node-local memory (``/dev/shm`` where it exists): 1 while its
engine has work (and while it starts: loading a model keeps its cores busy), 0 while idle.
A borrower maps the same file read-only and reads it before each of its steps, at the cost of
one memory read.

Contract:
- The owner creates the file if missing and never truncates or replaces it, so a borrower's
  mapping stays live across the owner's restarts; a restarted owner says busy until its
  engine first idles.
- Fail safe: a borrower that cannot map the file (the owner has not started yet) reads busy
  and retries at most once per ``REOPEN_INTERVAL_S``. An owner killed while busy leaves busy
  behind: its neighbour keeps to its own cores until the owner comes back. An owner killed
  while idle leaves idle: its cores are free, so borrowing them is right.
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

BUSY, IDLE = b"\x01", b"\x00"
REOPEN_INTERVAL_S = 1.0
"""How often a borrower retries mapping a flag file that was missing."""


class BusyFlag:
    """The owner's side: publishes its engine's state in ``path`` (created busy); OSError
    where the file cannot be created or written."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            if os.fstat(fd).st_size < 1:  # a new file: its byte written (busy), not a hole, so
                os.pwrite(fd, BUSY, 0)  # a full tmpfs is an OSError here, never a SIGBUS later
            self._map = mmap.mmap(fd, 1)
        finally:
            os.close(fd)
        self._busy: bool | None = None
        self.set(True)

    def set(self, busy: bool) -> None:
        """Publish ``busy`` (a write only when it changes)."""
        if busy != self._busy:
            self._map[0:1] = BUSY if busy else IDLE
            self._busy = busy


class BusyFlagReader:
    """A borrower's view of another worker's ``BusyFlag`` file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._map: mmap.mmap | None = None
        self._next_open_at = 0.0

    def is_busy(self) -> bool:
        """The owner's last published state; busy while its file cannot be mapped."""
        if self._map is None and not self._try_open():
            return True
        assert self._map is not None
        return self._map[0:1] != IDLE

    def _try_open(self) -> bool:
        now = time.monotonic()
        if now < self._next_open_at:
            return False
        self._next_open_at = now + REOPEN_INTERVAL_S
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return False
        try:
            if os.fstat(fd).st_size < 1:
                return False
            self._map = mmap.mmap(fd, 1, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return True
