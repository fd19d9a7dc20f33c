"""How many threads each engine step runs on: its own cores', plus a neighbour's while idle.

A worker pinned to its own cores (``--cpu-affinity``) may also be allowed a co-located
worker's cores (``--borrow-cores``) while that worker's engine has nothing to do (its
``common/busy_flag.py:BusyFlag``, ``--borrow-while-idle``). On a CPU whose cores each read
memory at a fraction of the socket's bandwidth, a decode step (bound by reading the weights)
is then up to twice as fast while the prefill worker beside it waits for prompts.

Contract (engine thread only):
- The process stays pinned to its own cores; only the engine thread (``start``, first thing
  on it) may also run on the borrowed ones, and with it the OpenMP pool it creates. Its
  gRPC, event-loop and transfer threads never leave the worker's own cores.
- ``before_step`` marks this engine busy (its own ``BusyFlag``, if it lends its cores) and
  sizes torch's pool for the step: own threads, plus one per borrowed core when their owner
  reads idle now and borrowing pays (below).
- The owner's state may change during a step (with ``up --core-lending both`` a prefill
  step can last seconds). ``between_layers`` (called by the model before each layer but the
  first and before each MLP of a step with prompt rows; a decode step's layer loop in C runs
  whole, tens of milliseconds) follows it: a borrowing step whose owner turned busy shrinks
  the pool back to the own threads, so the owner shares its core for at most a layer's
  attention or MLP; a step begun on
  its own cores because the owner was busy takes the borrowed ones once the owner idles
  (unless borrowing measured no faster), at most once a step. Such a step is no sample of
  either kind.
- ``idle`` marks this engine idle; call it before the engine thread waits for work.
- The kernels read ``torch.get_num_threads()`` at each call, so one resize per step covers
  oneDNN's products and splitserve's C kernels alike. An engine that only lends never
  resizes its pool.
- Borrowing is measured, not assumed (``after_step``). Only steps taken while the lender
  read idle are compared: each one's time over what the engine's step-time model predicted
  for it (``engine/engine_core.py:StepTiming``), averaged per kind (own cores only, borrowed
  too). Until each kind has ``MIN_SAMPLES`` such steps, the kinds alternate; then an idle
  lender's cores are taken only while borrowed steps run at most ``FASTER`` of own ones (a
  borrowed core shared with other processes, such as a coordinator, a gateway or the
  client, holds up every parallel region of the step), and one idle step in ``RETRY_EVERY``
  tries the other kind, so the comparison follows the load.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Protocol

import torch

from splitserve.common.busy_flag import BusyFlag

MIN_SAMPLES = 8
"""Idle-lender steps of each kind (own cores, borrowed ones) before one is preferred."""
FASTER = 0.95
"""Borrowed steps must take at most this share of own steps' time (relative to prediction)."""
RETRY_EVERY = 50
"""Once one kind is preferred, one idle-lender step in this many takes the other."""
SMOOTHING = 0.1
"""Weight of the newest step in each kind's running mean of log(time / predicted)."""


class LenderState(Protocol):
    """A lender's published state as a borrower reads it (``BusyFlagReader``)."""

    def is_busy(self) -> bool: ...


@dataclass(frozen=True)
class BorrowedCores:
    """Cores this worker may run its steps on while ``owner`` reads idle."""

    cores: frozenset[int]
    owner: LenderState

    def __post_init__(self) -> None:
        if not self.cores:
            raise ValueError("no cores to borrow")


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
        self.yielded_steps = 0
        """Of ``borrowed_steps``, those that gave the borrowed cores back part-way, their
        owner turning busy (``between_layers``)."""
        self.grown_steps = 0
        """Steps begun on own cores (their owner busy) that took the borrowed cores
        part-way, the owner having idled (``between_layers``)."""
        self._borrowing = False
        """Whether the step now running holds borrowed cores."""
        self._may_grow = False
        """Whether the step now running may still take the borrowed cores part-way."""
        self.declined_steps = 0
        """Steps that kept to own cores while the lender idled (borrowing measured no
        faster, or a trial of own cores)."""
        self._measured: bool | None = None
        """Kind of the step now running (True: borrowed) when its lender read idle; None
        for a step that compares nothing (the lender busy, or nothing to borrow)."""
        self._log_ratio = {False: 0.0, True: 0.0}
        """Per kind: running mean of log(step time / predicted), idle-lender steps only."""
        self._samples = {False: 0, True: 0}
        self._idle_steps = 0

    def start(self) -> None:
        """On the engine thread, before its first step: let it (and the OpenMP pool it will
        create) run on the borrowed cores too."""
        if self.borrows is not None:
            os.sched_setaffinity(0, os.sched_getaffinity(0) | self.borrows.cores)

    def before_step(self) -> None:
        if self.lends is not None:
            self.lends.set(True)
        self.steps += 1
        if self.borrows is None:
            return
        self._measured = None
        borrow = False
        owner_busy = self.borrows.owner.is_busy()
        if not owner_busy:
            borrow = self._measured = self._borrow_from_idle_lender()
            if not borrow:
                self.declined_steps += 1
        self._may_grow = owner_busy and self.borrowing_pays() is not False
        threads = self.own_threads
        if borrow:
            threads += len(self.borrows.cores)
            self.borrowed_steps += 1
        self._borrowing = borrow
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    def between_layers(self) -> None:
        """Within a step (engine thread): give the borrowed cores back at once if their
        owner turned busy, or take them if the step may grow and their owner idles now."""
        if self.borrows is None or not (self._borrowing or self._may_grow):
            return
        owner_busy = self.borrows.owner.is_busy()
        if self._borrowing and owner_busy:
            self._borrowing = False
            self._measured = None  # part borrowed, part own: no sample of either kind
            self.yielded_steps += 1
            torch.set_num_threads(self.own_threads)
        elif self._may_grow and not owner_busy:
            self._may_grow = False
            self._borrowing = True
            self.grown_steps += 1
            torch.set_num_threads(self.own_threads + len(self.borrows.cores))

    def after_step(self, seconds: float, predicted_s: float) -> None:
        """Learn from the step just run (its time, the model's prediction; 0: none)."""
        kind = self._measured
        if kind is None or seconds <= 0.0 or predicted_s <= 0.0:
            return
        log_ratio = math.log(seconds / predicted_s)
        if self._samples[kind] == 0:
            self._log_ratio[kind] = log_ratio
        else:
            self._log_ratio[kind] += SMOOTHING * (log_ratio - self._log_ratio[kind])
        self._samples[kind] += 1

    def borrowing_pays(self) -> bool | None:
        """Whether borrowed steps have measured at least ``1 - FASTER`` faster than own ones
        (idle-lender steps); None until each kind has ``MIN_SAMPLES``."""
        if min(self._samples.values()) < MIN_SAMPLES:
            return None
        return self._log_ratio[True] - self._log_ratio[False] <= math.log(FASTER)

    def _borrow_from_idle_lender(self) -> bool:
        """Whether this step, its lender idle, takes the borrowed cores."""
        self._idle_steps += 1
        pays = self.borrowing_pays()
        if pays is None:  # still comparing: the kind with fewer samples
            return self._samples[True] <= self._samples[False]
        if self._idle_steps % RETRY_EVERY == 0:
            return not pays  # a trial of the other kind, so the comparison follows the load
        return pays

    def idle(self) -> None:
        if self.lends is not None:
            self.lends.set(False)
