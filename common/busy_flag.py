"""Whether a worker's engine has work, published to the workers beside it on one machine.

Co-located workers lend each other their cores (``engine/step_threads.py``): a worker whose
engine sits idle lets a neighbour run its steps with more threads. Each lending worker owns a
``BusyFlag`` file in node-local memory (``/dev/shm`` where it exists), ``SIZE`` bytes: byte 0
is 1 while its engine has work (and while it starts: loading a model keeps its cores busy), 0
while idle; bytes 8-15 say, while idle, until when (a float64 of ``time.monotonic()``, one
clock for every process of the machine; 0.0: until work comes, unknown). An engine that holds
its next step back on purpose (a decode worker pacing its steps, ``engine/decode_pace.py``)
knows when it will want its cores again, and a borrower reads that to take them only for what
fits before. A borrower maps the same file read-only and reads it before each of its steps,
at the cost of a memory read or two.

Contract:
- The owner creates the file if missing and never truncates or replaces it, so a borrower's
  mapping stays live across the owner's restarts; a restarted owner says busy until its
  engine first idles.
- The owner writes the time before the flag, so a borrower that reads idle reads the time of
  that idle spell or a later one. A file of one byte (an older owner) has no time: 0.0.
- Fail safe: a borrower that cannot map the file (the owner has not started yet) reads busy
  and retries at most once per ``REOPEN_INTERVAL_S``. An owner killed while busy leaves busy
  behind: its neighbour keeps to its own cores until the owner comes back. An owner killed
  while idle leaves idle: its cores are free, so borrowing them is right.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path

BUSY, IDLE = b"\x01", b"\x00"
SIZE = 16
"""Bytes of a flag file: the flag, padding, the idle spell's end."""
_UNTIL = struct.Struct("<d")
_UNTIL_AT = 8
REOPEN_INTERVAL_S = 1.0
"""How often a borrower retries mapping a flag file that was missing."""


class BusyFlag:
    """The owner's side: publishes its engine's state in ``path`` (created busy); OSError
    where the file cannot be created or written."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            if os.fstat(fd).st_size < SIZE:  # new (or an older owner's): its bytes written, not
                # a hole, so a full tmpfs is an OSError here, never a SIGBUS later
                os.pwrite(fd, BUSY + bytes(SIZE - 1), 0)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._busy: bool | None = None
        self._until = 0.0
        self.set(True)

    def set(self, busy: bool, idle_until: float = 0.0) -> None:
        """Publish ``busy``, and while idle until when (``time.monotonic()``; 0.0: until work
        comes); a write only where something changes."""
        until = 0.0 if busy else idle_until
        if not busy and until != self._until:
            self._map[_UNTIL_AT : _UNTIL_AT + _UNTIL.size] = _UNTIL.pack(until)
            self._until = until
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

    def idle_until(self) -> float:
        """While the owner reads idle: until when it said (``time.monotonic()``), 0.0 where it
        did not (it waits for work) or its file has no time."""
        if self._map is None or len(self._map) < SIZE:
            return 0.0
        return _UNTIL.unpack_from(self._map, _UNTIL_AT)[0]

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
            size = os.fstat(fd).st_size
            if size < 1:
                return False
            self._map = mmap.mmap(fd, SIZE if size >= SIZE else 1, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return True
