"""``common/startup_heap.py``: start-up objects leave the collector's passes, later ones do not."""

from __future__ import annotations

import gc
import weakref

from splitserve.common.startup_heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_freeze_exempts_start_up_objects_and_collects_later_ones() -> None:
    before = _Node()
    before_ref = weakref.ref(before)
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() > 0
        after = _Node()
        after_ref = weakref.ref(after)
        del before, after
        gc.collect()
        assert after_ref() is None  # made while serving: collected as before
        assert before_ref() is not None  # frozen: never walked, so never freed
    finally:
        gc.unfreeze()
    gc.collect()
    assert before_ref() is None
