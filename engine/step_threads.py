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
- Borrowing is measured, not assumed (``after_step``): each step's time over what the
  engine's step-time model predicted for it (``EngineCore.last_step``) is averaged per kind,
  steps on own cores and steps on borrowed ones too. Once both kinds have ``MIN_SAMPLES``,
  an idle lender's cores are taken only while borrowed steps run at most ``FASTER`` of own
  ones: on a machine where the borrowed core is shared with other processes (a coordinator,
  a gateway, the client), a thread there holds up every parallel region of the step, and the
  step is slower than on its own core. While declining, every ``RETRY_EVERY``-th step borrows
  again, so the comparison follows the load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from splitserve.common.busy_flag import BusyFlag, BusyFlagReader

MIN_SAMPLES = 8
"""Steps of each kind (own cores, borrowed ones) before borrowing can be declined."""
FASTER = 0.95
"""Borrowed steps must take at most this share of own steps' time (relative to prediction)."""
RETRY_EVERY = 50
"""While declining, one step in this many borrows anyway, to keep measuring."""
SMOOTHING = 0.1
"""Weight of the newest step in each kind's running mean of log(time / predicted)."""


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
        self.declined_steps = 0
        """Steps that kept to own cores while the lender idled (borrowing measured slower)."""
        self._borrowing = False
        """Whether the step now running (or the last) was sized with borrowed cores."""
        self._log_ratio = {False: 0.0, True: 0.0}
        """Per kind (borrowed or not): running mean of log(step time / predicted)."""
        self._samples = {False: 0, True: 0}
        self._declined_in_a_row = 0

    def before_step(self) -> None:
        if self.lends is not None:
            self.lends.set(True)
        self._borrowing = (
            self.borrows is not None and not self.borrows.owner.is_busy() and self._worth_it()
        )
        threads = self.own_threads
        if self._borrowing:
            assert self.borrows is not None
            threads += self.borrows.num_cores
            self.borrowed_steps += 1
        self.steps += 1
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    def after_step(self, seconds: float, predicted_s: float) -> None:
        """Learn from the step just run (its time, the model's prediction; 0: none)."""
        if seconds <= 0.0 or predicted_s <= 0.0:
            return
        kind = self._borrowing
        log_ratio = math.log(seconds / predicted_s)
        if self._samples[kind] == 0:
            self._log_ratio[kind] = log_ratio
        else:
            self._log_ratio[kind] += SMOOTHING * (log_ratio - self._log_ratio[kind])
        self._samples[kind] += 1

    def borrowing_pays(self) -> bool | None:
        """Whether borrowed steps have measured faster than own ones; None until each kind
        has ``MIN_SAMPLES``."""
        if min(self._samples.values()) < MIN_SAMPLES:
            return None
        return self._log_ratio[True] - self._log_ratio[False] <= math.log(FASTER)

    def _worth_it(self) -> bool:
        """Whether to borrow the idle lender's cores for this step."""
        if self.borrowing_pays() is not False:
            self._declined_in_a_row = 0
            return True
        self._declined_in_a_row += 1
        if self._declined_in_a_row >= RETRY_EVERY:
            self._declined_in_a_row = 0
            return True
        self.declined_steps += 1
        return False

    def idle(self) -> None:
        if self.lends is not None:
            self.lends.set(False)
