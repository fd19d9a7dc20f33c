"""``splitserve up``'s children, kept running: each one that dies is started again.

A ``Supervisor`` starts named children (``ChildProcess``, each in its own session so Ctrl-C
reaches only ``up``), forwards their output with a ``[name]`` prefix, and, once ``supervise``
runs, restarts any child that ends on its own with the same command line, after a back-off
that doubles with each quick death (``RESTART_BASE_S`` up to ``RESTART_MAX_S``; a child that
ran ``STABLE_AFTER_S`` before it died starts again from the base). The others keep serving
meanwhile: a restarted worker registers with the coordinator again; a restarted coordinator
or gateway binds the ports its first run announced (``pin`` rewrites ``--port=0``). With
``restart=False`` the first death ends ``supervise`` instead (the old all-or-nothing mode).
Children may be started while ``supervise`` runs; ``retire`` drains one for good (SIGTERM, a
kill only after the drain timeout) and forgets it (``launch/local_autoscaler.py``). A child
started as an ``engine`` (a worker) runs, every time it is started, at ``engine_nice``
(``launch/cpu_priority.py``), below the front end's default priority.

Invariants: ``stop_all`` stops the current process of every child, last started first; no
restart begins once ``stop`` is set; a retired child is never restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import TextIO, TypeVar

from splitserve.common.event_wait import wait_event
from splitserve.common.orphan import PARENT_PID_ENV
from splitserve.launch.child_process import (
    ChildExited,
    ChildProcess,
    ReadyError,
    StopResult,
    python_module_argv,
)
from splitserve.launch.cpu_priority import lower_priority

STOP_MARGIN_S = 10.0
"""How long a child may take to stop after SIGTERM beyond its drain timeout before it is
killed."""
READY_TIMEOUT_S = 300.0
RESTART_BASE_S = 1.0
RESTART_MAX_S = 30.0
STABLE_AFTER_S = 60.0

T = TypeVar("T")
_print_lock = threading.Lock()


def say(text: str, file: TextIO | None = None) -> None:
    """One whole line to stdout (or ``file``); children's drain threads print concurrently."""
    with _print_lock:
        print(text, file=file or sys.stdout, flush=True)


class Stopped(Exception):
    """Ctrl-C / SIGTERM arrived while a child was starting."""


@dataclass
class Child:
    """One supervised child: its command line and its current process."""

    name: str
    module_argv: list[str]
    """``python -m`` module and flags; ``pin`` may rewrite flags for restarts."""
    process: ChildProcess
    started_at: float = field(default_factory=time.monotonic)
    quick_deaths: int = 0
    """Deaths in a row, each within ``STABLE_AFTER_S`` of its start."""
    retired: bool = False
    """Being drained for good (``Supervisor.retire``): never restarted."""
    engine: bool = False
    """Runs an engine (a worker): started at the supervisor's ``engine_nice``."""

    def pin(self, flag: str, value: str) -> None:
        """Restarts pass ``flag=value`` (e.g. the port the first run was given when asked
        for any free one)."""
        kept = [arg for arg in self.module_argv if not arg.startswith(f"{flag}=")]
        self.module_argv = [*kept, f"{flag}={value}"]

    def next_delay_s(self) -> float:
        """The back-off before the next restart, counting the death that just happened."""
        if time.monotonic() - self.started_at >= STABLE_AFTER_S:
            self.quick_deaths = 0
        self.quick_deaths += 1
        return min(RESTART_BASE_S * 2 ** (self.quick_deaths - 1), RESTART_MAX_S)


class Supervisor:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        env: Mapping[str, str],
        restart: bool = True,
        drain_timeout_s: float = 30.0,
        engine_nice: int = 0,
    ) -> None:
        """``env``: added to every child's environment; ``restart``: see the module doc;
        ``drain_timeout_s``: the children's ``--drain-timeout``, which ``stop_all`` waits
        out (plus ``STOP_MARGIN_S``) before it kills one; ``engine_nice``: the niceness of
        the children started as engines (0: the default priority, like the others)."""
        self.engine_nice = engine_nice
        self._grace_s = drain_timeout_s + STOP_MARGIN_S
        self.children: list[Child] = []
        self.restart = restart
        self._exited = asyncio.Event()
        self._loop = loop
        self._env = dict(env) | {PARENT_PID_ENV: str(os.getpid())}  # common/orphan.py
        self._restarting: set[str] = set()
        self.restarts = 0

    def start(self, name: str, module_argv: list[str], *, engine: bool = False) -> Child:
        """Start ``python -m <module_argv>`` as child ``name``; an ``engine`` (a worker)
        at ``engine_nice``."""
        process = self._spawn(name, module_argv, engine)
        child = Child(name, list(module_argv), process, engine=engine)
        self.children.append(child)
        return child

    def _spawn(self, name: str, module_argv: list[str], engine: bool) -> ChildProcess:
        process = ChildProcess(
            python_module_argv(*module_argv),
            name=name,
            env=self._env,
            new_session=True,  # Ctrl-C reaches only us; we stop the children in order
            on_line=lambda line: say(f"[{name}] {line}"),
            on_exit=self._note_exit,
        )
        if engine:
            for problem in lower_priority(process.pid, self.engine_nice):
                say(f"splitserve up: {name} keeps the default CPU priority: {problem}")
        return process

    def _note_exit(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is waiting
            self._loop.call_soon_threadsafe(self._exited.set)

    async def wait_ready(self, child: Child, stop: asyncio.Event, marker: str | None = None) -> str:
        """``child``'s ready address (of the announcement containing ``marker``, if given);
        ``Stopped`` if ``stop`` is set first; ``ReadyError`` if it fails to start."""
        process = child.process
        ready = asyncio.ensure_future(
            asyncio.to_thread(process.wait_ready, marker, READY_TIMEOUT_S)
        )
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([ready, stopped], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if stop.is_set():
            if ready.done():
                ready.exception()  # retrieved: the stop wins
            else:
                ready.cancel()  # its thread ends once the child is stopped
            raise Stopped()
        return ready.result()

    async def guard(self, work: Awaitable[T], stop: asyncio.Event) -> T:
        """``work``'s result, awaited while the children start; ``Stopped`` if ``stop`` is
        set first, ``ChildExited`` (a ``ReadyError``) if a child ends first."""
        task = asyncio.ensure_future(work)
        stopped = asyncio.ensure_future(stop.wait())
        exited = asyncio.ensure_future(self._exited.wait())
        try:
            await asyncio.wait([task, stopped, exited], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            exited.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if stop.is_set():
            raise Stopped()
        dead = next(c for c in self.children if c.process.returncode is not None)
        raise ChildExited(dead.name, dead.process.returncode, dead.process.tail())

    async def supervise(self, stop: asyncio.Event) -> None:
        """Until ``stop``: restart children that end (or, without ``restart``, return at
        the first that does)."""
        while not stop.is_set():
            waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wait())]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for task in waits:
                task.cancel()
            if stop.is_set():
                return
            self._exited.clear()
            for child in self.children:
                status = child.process.returncode
                if status is None or child.name in self._restarting or child.retired:
                    continue
                if not self.restart:
                    say(f"splitserve up: {child.name} exited with status {status}; stopping")
                    return
                self._restarting.add(child.name)
                asyncio.ensure_future(self._restart(child, status, stop))

    async def _wait(self) -> None:
        await self._exited.wait()

    async def _restart(self, child: Child, status: int, stop: asyncio.Event) -> None:
        delay_s = child.next_delay_s()
        say(f"splitserve up: {child.name} exited with status {status}; restarting in {delay_s:g} s")
        if await wait_event(stop, delay_s):
            self._restarting.discard(child.name)
            return
        child.process = self._spawn(child.name, child.module_argv, child.engine)
        child.started_at = time.monotonic()
        self.restarts += 1
        self._restarting.discard(child.name)  # from now on its death is seen as a new one
        with contextlib.suppress(Stopped, ReadyError):  # a failed start is its next death
            address = await self.wait_ready(child, stop)
            say(f"splitserve up: {child.name} is back, ready at {address}")

    async def retire(self, child: Child) -> StopResult:
        """Drain ``child`` for good: SIGTERM (a worker finishes every request it holds within
        its drain timeout), SIGKILL only after ``drain_timeout_s + STOP_MARGIN_S``; then
        forget it. It is not restarted, whenever its process ends."""
        child.retired = True
        result = await asyncio.to_thread(child.process.stop, self._grace_s)
        with contextlib.suppress(ValueError):  # stop_all may have run meanwhile
            self.children.remove(child)
        return result

    async def stop_all(self) -> bool:
        """SIGTERM every child (last started first), SIGKILL those still running after the
        grace period; False when some child had to be killed."""
        for child in reversed(self.children):
            child.process.terminate()
        clean = True
        for child in reversed(self.children):
            if (await asyncio.to_thread(child.process.stop, self._grace_s)).killed:
                say(f"splitserve up: {child.name} ignored SIGTERM; killed it")
                clean = False
        return clean
