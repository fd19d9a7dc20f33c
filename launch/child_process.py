"""One child process of a launcher: started, its output drained, waited for, stopped.

``ChildProcess(argv, ...)`` starts ``argv`` (``python_module_argv`` builds ``python -m``
argvs) with stdout and stderr merged into one pipe that a daemon thread drains line by line.
Each line, in order:

- goes to the log file, when one is given (created or truncated at start, closed at EOF);
- goes to ``on_line``, when given (called on the drain thread: keep it short, thread-safe);
- is kept in a bounded tail for error messages (lines containing any of ``tail_excludes``
  are left out of the tail only);
- is parsed for an announcement, ``<what> ready at <address>`` or ``<what> metrics at
  <url>`` (``ANNOUNCEMENT``, the only parser of these lines), e.g. "splitserve decode ready"
  at "127.0.0.1:40123", or "decode metrics" at "http://127.0.0.1:9402/metrics". A prefix
  such as ``[decode-0] `` (``splitserve up`` forwarding its children) is not part of ``what``.

At EOF the thread reaps the process and then calls ``on_exit`` (once). So asyncio code can
use a ``ChildProcess`` through callbacks (``loop.call_soon_threadsafe`` in them) and
``asyncio.to_thread`` for the blocking calls (``wait_ready``, ``stop``).

``wait_ready`` blocks until an announcement that contains the marker is seen and returns its
address; it raises ``ChildExited`` if the process ends first and ``NotReady`` at the timeout,
both carrying the output's tail. ``stop`` sends SIGTERM, waits a grace period, then SIGKILLs
the process (its whole process group when it was started in a new session).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ANNOUNCEMENT = re.compile(r"(?P<what>\w[\w +-]* (?:ready|metrics)) at (?P<where>\S+)$")
"""``<what> ready at <address>`` / ``<what> metrics at <url>`` at the end of a line."""

DRAIN_JOIN_S = 2.0
"""How long ``stop`` and ``wait_ready`` wait for the last lines once the process has ended."""


@dataclass(frozen=True)
class Announcement:
    """One parsed announcement line: ``what`` ends with " ready" or " metrics"."""

    what: str
    where: str

    @property
    def text(self) -> str:
        """The announcement without any prefix, e.g. "splitserve ready at 127.0.0.1:50051"."""
        return f"{self.what} at {self.where}"

    @property
    def is_ready(self) -> bool:
        return self.what.endswith(" ready")


@dataclass(frozen=True)
class StopResult:
    """How a child ended: ``status`` as ``Popen.returncode`` (negative: killed by that signal);
    ``killed`` when ``stop`` had to SIGKILL it because it outlived the grace period."""

    status: int
    killed: bool


class ReadyError(Exception):
    """The child did not become ready: ``summary`` says why in one line, ``tail`` is the end
    of its output; ``str()`` is both."""

    def __init__(self, name: str, summary: str, tail: str) -> None:
        self.name, self.summary, self.tail = name, summary, tail
        super().__init__(f"{summary}:\n{tail}")


class ChildExited(ReadyError, RuntimeError):
    """The child ended, with ``status``, before it announced it was ready."""

    def __init__(self, name: str, status: int, tail: str) -> None:
        self.status = status
        super().__init__(name, f"{name} exited with status {status}", tail)


class NotReady(ReadyError, TimeoutError):
    """The child did not announce it was ready within ``timeout_s`` (it is still running)."""

    def __init__(self, name: str, timeout_s: float, tail: str) -> None:
        self.timeout_s = timeout_s
        super().__init__(name, f"{name} was not ready within {timeout_s:.0f}s", tail)


def python_module_argv(module: str, *args: str) -> list[str]:
    """``python -m module args`` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def role_of_process(pid: int) -> str | None:
    """The role a process runs: the ``<role>`` of the ``splitserve.<role>.main`` its command
    line names (``python_module_argv`` of a role's module), read from /proc; None for any
    other process, or one that is gone."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    for word in argv:
        parts = word.split(b".")
        if len(parts) == 3 and parts[0] == b"splitserve" and parts[2] == b"main":
            return parts[1].decode(errors="replace")
    return None


def children_by_role(pid: int) -> Counter[str]:
    """How many live child processes of ``pid`` (started by any of its threads) run each
    role (``role_of_process``). A child that ends while it is read is not counted."""
    counts: Counter[str] = Counter()
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            children = task.read_text().split()
        except OSError:
            continue
        for child in children:
            role = role_of_process(int(child))
            if role is not None:
                counts[role] += 1
    return counts


class ChildProcess:
    """A started child process and what it has printed; see the module docstring.

    Invariants: ``announcements()`` and the tail only grow in output order; ``on_exit`` runs
    after the process has been reaped, at most once; ``stop`` may be called any number of
    times and from any thread (after the first, it only reports the status)."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        new_session: bool = False,
        on_line: Callable[[str], None] | None = None,
        on_exit: Callable[[], None] | None = None,
        tail_lines: int = 200,
        tail_excludes: Sequence[str] = (),
    ) -> None:
        self.argv = list(argv)
        self.name = name or self.argv[0]
        self.new_session = new_session
        self._on_line = on_line
        self._on_exit = on_exit
        self._tail: deque[str] = deque(maxlen=tail_lines)
        self._tail_excludes = tuple(tail_excludes)
        self._announcements: list[Announcement] = []
        self._changed = threading.Condition()
        self._drained = False
        self._log = log_path.open("w", encoding="utf-8") if log_path is not None else None
        try:
            self.popen: subprocess.Popen[str] = subprocess.Popen(
                self.argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                encoding="utf-8",
                errors="replace",
                env=None if env is None else os.environ | dict(env),
                start_new_session=new_session,
            )
        except BaseException:
            if self._log is not None:
                self._log.close()
            raise
        self._drain_thread = threading.Thread(
            target=self._drain, name=f"drain {self.name}", daemon=True
        )
        self._drain_thread.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once the process has ended, else None."""
        return self.popen.poll()

    def announcements(self) -> dict[str, str]:
        """Every announcement so far as {what: where}; a later one replaces an equal ``what``."""
        with self._changed:
            return {a.what: a.where for a in self._announcements}

    def tail(self, count: int = 40) -> str:
        """The last ``count`` kept lines of output, for error messages."""
        with self._changed:
            return "\n".join(list(self._tail)[-count:])

    def wait_ready(self, marker: str | None = None, timeout_s: float = 300.0) -> str:
        """The address of the first ready announcement whose text ("<what> ready at
        <address>", without prefix) contains ``marker`` (any ready announcement when None).
        Raises ``ChildExited`` when the process ends first, ``NotReady`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                address = self._ready_address(marker)
                if address is not None:
                    return address
                if self.popen.poll() is not None:
                    self._changed.wait_for(lambda: self._drained, DRAIN_JOIN_S)  # last lines
                    address = self._ready_address(marker)
                    if address is not None:
                        return address
                    raise ChildExited(self.name, self.popen.returncode, self.tail())
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise NotReady(self.name, timeout_s, self.tail())
                self._changed.wait(min(remaining, 0.5))

    def terminate(self) -> None:
        """Send SIGTERM (to the process group when the child has its own session, so that a
        server's own children stop too) unless the process has ended; returns at once."""
        if self.popen.poll() is None:
            self._signal(signal.SIGTERM)

    def stop(self, grace_s: float) -> StopResult:
        """SIGTERM, wait up to ``grace_s``, then SIGKILL (both to the process group when the
        child has its own session); returns once the process is reaped and its output drained (or
        ``DRAIN_JOIN_S`` passed: a grandchild may hold the pipe open)."""
        self.terminate()
        killed = False
        try:
            status = self.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            killed = True
            self._kill()
            status = self.popen.wait()
        self._drain_thread.join(DRAIN_JOIN_S)
        return StopResult(status, killed)

    def _kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, signum: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            if self.new_session:
                os.killpg(self.popen.pid, signum)
            else:
                self.popen.send_signal(signum)

    def _ready_address(self, marker: str | None) -> str | None:
        for announcement in self._announcements:
            if announcement.is_ready and (marker is None or marker in announcement.text):
                return announcement.where
        return None

    def _drain(self) -> None:
        assert self.popen.stdout is not None
        try:
            for raw in self.popen.stdout:
                self._take(raw.rstrip("\r\n"))
        finally:
            if self._log is not None:
                self._log.close()
            self.popen.wait()
            with self._changed:
                self._drained = True
                self._changed.notify_all()
            if self._on_exit is not None:
                self._on_exit()

    def _take(self, line: str) -> None:
        if self._log is not None:
            self._log.write(line + "\n")
            self._log.flush()
        if self._on_line is not None:
            self._on_line(line)
        announced = ANNOUNCEMENT.search(line.rstrip())
        with self._changed:
            if not any(excluded in line for excluded in self._tail_excludes):
                self._tail.append(line)
            if announced is not None:
                self._announcements.append(Announcement(announced["what"], announced["where"]))
                self._changed.notify_all()
