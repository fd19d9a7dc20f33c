"""The garbage collector of a serving process: start-up objects frozen, collections rarer.

A role process builds most of its Python objects before it serves: modules, torch's model and
its parameters, FastAPI's and pydantic's schemas, gRPC's stubs. CPython's full (generation 2)
collection walks every tracked object, so in a serving process each one re-walks that start-up
heap while the event loop (and, holding the GIL, every other thread) waits. And with CPython's
default thresholds (a young collection every 700 net allocations, a full one every 100 young
ones, subject to its 25% rule) a crowd of in-flight requests, each alive for seconds, triggers
full collections that walk all of them. Measured on the 2-core Cascade Lake Xeon of 2026-11-27,
a crowd of 2,000 requests on ``make serve``, pauses (gen 1 and 2) while it lasted:

- defaults: the gateway 0.94 s in full collections (the longest 0.38-0.43 s), the decode
  worker 0.60-0.69 s (0.16-0.19 s), the prefill worker 0.21-0.23 s;
- start-up frozen: gateway 0.51-0.60 s (0.23-0.38), decode 0.09-0.18 s (0.03-0.11), prefill
  5 ms;
- frozen and ``SERVING_THRESHOLDS``: no collection past the youngest generation in any
  process while the crowd lasted (a young threshold of 10,000 still left gen-1 passes of
  0.1-0.2 s in the gateway).

Contract: ``tune_gc_for_serving`` is called after start-up, before the role reports ready (its
``ready at`` line); a process hosting several workers calls it once for each, freezing what
each one's start-up added. It collects once, then moves every object that survived into
CPython's permanent generation (``gc.freeze``): those are never collected or walked again (one
dropped later is leaked, not freed: rare, and bounded by the start-up heap), and sets
``SERVING_THRESHOLDS``. Objects made while serving are still collected, by rarer passes that
walk only them: cyclic garbage lives up to ``SERVING_THRESHOLDS[0]`` allocations longer (a few
MB). It logs how many objects it froze (INFO) and returns that count.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)

SERVING_THRESHOLDS = (50_000, 10, 10)
"""``gc.set_threshold`` while serving: a young collection every 50,000 net allocations (not
700), an older one every 10 of those, as CPython's defaults count."""


def tune_gc_for_serving() -> int:
    """Collect, freeze every survivor, set ``SERVING_THRESHOLDS``; the count frozen (logged)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVING_THRESHOLDS)
    frozen = gc.get_freeze_count()
    logger.info("%d start-up objects frozen out of full collections", frozen)
    return frozen
