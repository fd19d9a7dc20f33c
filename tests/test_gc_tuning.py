"""``common/gc_tuning.py``: start-up objects leave the collector's passes, later ones do not,
and collections run at the serving thresholds."""

from __future__ import annotations

import gc
import weakref

from splitserve.common.gc_tuning import SERVING_THRESHOLDS, tune_gc_for_serving


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_start_up_objects_are_frozen_and_later_ones_still_collected() -> None:
    before = _Node()
    before_ref = weakref.ref(before)
    thresholds = gc.get_threshold()
    try:
        frozen = tune_gc_for_serving()
        assert frozen == gc.get_freeze_count() > 0
        assert gc.get_threshold() == SERVING_THRESHOLDS
        after = _Node()
        after_ref = weakref.ref(after)
        del before, after
        gc.collect()
        assert after_ref() is None  # made while serving: collected as before
        assert before_ref() is not None  # frozen: never walked, so never freed
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
    gc.collect()
    assert before_ref() is None
