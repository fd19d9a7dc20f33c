"""Real clusters shared by consecutive test modules, each started once and stopped after the
last test that uses it.

A ``Shared`` holds one resource (a running cluster) made by a context manager factory: ``get()``
starts it on first use and returns the same value after; ``stop()`` leaves the context (the
cluster's processes get SIGTERM and must exit cleanly, else ``stop`` raises with their tail).

The conftest wires each ``Shared`` to a session-scoped fixture of the same name and to three
collection rules (``group_users``, ``last_users``):
- modules that use a shared fixture run one after the other, in the place of the first of
  them (every other module keeps its order), so each cluster starts once;
- the last test that uses it stops it in its own teardown, so a failure to stop is reported
  against a test and no idle cluster runs beside the rest of the suite;
- whatever is still running at the end of the session is stopped then (a deselected or
  skipped last user).

Invariant: after every test that used it, a shared cluster is whole again (its ``after_each``
starts what the test killed, or a supervisor did), so the next user finds it as the first did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

import pytest

T = TypeVar("T")


class Shared(Generic[T]):
    """One lazily started resource; see the module docstring."""

    def __init__(
        self,
        name: str,
        factory: Callable[[], contextlib.AbstractContextManager[T]],
        after_each: Callable[[T], None] | None = None,
    ) -> None:
        """``after_each``: called with the value after every test that used it (e.g. to start
        again what the test killed)."""
        self.name = name
        self._factory = factory
        self._after_each = after_each
        self._stack: contextlib.ExitStack | None = None
        self._value: T | None = None

    @property
    def running(self) -> bool:
        return self._stack is not None

    def get(self) -> T:
        if self._stack is None:
            with contextlib.ExitStack() as stack:
                value = stack.enter_context(self._factory())
                self._stack = stack.pop_all()
            self._value = value
        assert self._value is not None
        return self._value

    def after_test(self) -> None:
        """Run ``after_each`` on the running value (nothing when it does not run)."""
        if self._after_each is not None and self._value is not None:
            self._after_each(self._value)

    def stop(self) -> None:
        """Stop it if it runs; raises what stopping raised (after forgetting it)."""
        stack, self._stack, self._value = self._stack, None, None
        if stack is not None:
            stack.close()


def group_users(items: list[pytest.Item], names: Sequence[str]) -> list[pytest.Item]:
    """``items`` with the modules that use each of ``names`` moved together, to where the
    first of them was; the order within a module and of every other module is kept."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def shared_name(module_items: list[pytest.Item]) -> str | None:
        used = {name for item in module_items for name in names if name in _fixtures(item)}
        assert len(used) <= 1, f"a module uses two shared clusters: {sorted(used)}"
        return next(iter(used), None)

    ordered: list[pytest.Item] = []
    placed: set[str] = set()
    for module_items in modules.values():
        name = shared_name(module_items)
        if name is None:
            ordered += module_items
        elif name not in placed:
            placed.add(name)
            for others in modules.values():
                if shared_name(others) == name:
                    ordered += others
    return ordered


def last_users(items: Sequence[pytest.Item], names: Sequence[str]) -> dict[str, str]:
    """Shared fixture name -> node id of the last item (in run order) that uses it."""
    last: dict[str, str] = {}
    for item in items:
        for name in names:
            if name in _fixtures(item):
                last[name] = item.nodeid
    return last


def _fixtures(item: pytest.Item) -> Sequence[str]:
    return getattr(item, "fixturenames", ())


def stop_all(shared: Sequence[Shared[object]]) -> Iterator[str]:
    """Stop every running one; yields a message per one that failed to stop cleanly."""
    for resource in shared:
        try:
            resource.stop()
        except Exception as error:  # noqa: BLE001 - reported, the others still stopped
            yield f"{resource.name}: {error}"
