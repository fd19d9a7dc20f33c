"""How many threads each engine step runs on: its own cores', plus a neighbour's while idle.

A worker pinned to its own cores (``--cpu-affinity``) may also be allowed a co-located
worker's cores (``--borrow-cores``) while that worker's engine has nothing to do (its
``common/busy_flag.py:BusyFlag``, ``--borrow-while-idle``). On a CPU whose cores each read
memory at a fraction of the socket's bandwidth, a decode step (bound by reading the weights)
is then up to twice as fast while the prefill worker beside it waits for prompts, and keeps
to its own core while that worker computes one.

Contract (engine thread only):
- ``before_step`` marks this engine busy (its own ``BusyFlag``, if it lends its cores) and
  sizes torch's pool for the step: own threads, plus one per borrowed core when their owner
  reads idle now. The owner may turn busy during the step; the step then shares that core
  for its remainder (the cost of lending is at most one step).
- ``idle`` marks this engine idle; call it before the engine thread waits for work.
- The kernels read ``torch.get_num_threads()`` at each call, so one resize per step covers
  oneDNN's products and splitserve's C kernels alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.common.busy_flag import BusyFlag, BusyFlagReader


@dataclass(frozen=True)
class BorrowedCores:
    """Cores this worker may run on while ``owner`` (their worker's flag) reads idle."""

    num_cores: int
    owner: BusyFlagReader


class StepThreads:
    """Per-step thread count of one engine (see the module docstring)."""

    def __init__(
        self,
        own_threads: int,
        lends: BusyFlag | None = None,
        borrows: BorrowedCores | None = None,
    ) -> None:
        if own_threads <= 0:
            raise ValueError("own_threads must be positive")
        self.own_threads = own_threads
        self.lends = lends
        self.borrows = borrows
        self.steps = 0
        """Steps sized so far."""
        self.borrowed_steps = 0
        """Of ``steps``, those that ran on borrowed cores too."""

    def before_step(self) -> None:
        if self.lends is not None:
            self.lends.set(True)
        threads = self.own_threads
        if self.borrows is not None and not self.borrows.owner.is_busy():
            threads += self.borrows.num_cores
            self.borrowed_steps += 1
        self.steps += 1
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    def idle(self) -> None:
        if self.lends is not None:
            self.lends.set(False)
