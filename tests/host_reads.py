"""A guard that fails on every tensor operation handing a tensor's value to the host
(``bool``, ``int``, ``float``, ``item``, ``tolist``, ``nonzero``, ``cpu``, ``numpy``): on the
CPU it stands in for CUDA's sync debug mode, to show that code meant to queue work behind the
device (``Sampler.choose(wait_free=True)``, ``ModelRunner.launch_decode``) never waits for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch.overrides import TorchFunctionMode

T = TypeVar("T")


class HostReads(TorchFunctionMode):
    """``with HostReads():`` raises ``AssertionError("read on the host: ...")`` on a read."""

    READS = frozenset(
        {
            "__bool__",
            "__int__",
            "__float__",
            "__index__",
            "item",
            "tolist",
            "nonzero",
            "cpu",
            "numpy",
        }
    )

    def __init__(self) -> None:
        super().__init__()
        self._paused = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if not self._paused and getattr(func, "__name__", "") in self.READS:
            raise AssertionError(f"read on the host: {func.__name__}")
        return func(*args, **(kwargs or {}))

    def outside(self, run: Callable[[], T]) -> Callable[[], T]:
        """``run`` with the guard off while it runs: what a CUDA graph's replay does on the
        device, which a stand-in runs on the host (the Triton interpreter reads its tensors)."""

        def unguarded() -> T:
            self._paused += 1
            try:
                return run()
            finally:
                self._paused -= 1

        return unguarded


def guarded(guard: HostReads, call: Callable[..., T]) -> Callable[..., T]:
    """``call`` run under ``guard``."""

    def run(*args: Any, **kwargs: Any) -> T:
        with guard:
            return call(*args, **kwargs)

    return run
