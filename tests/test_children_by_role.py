"""``launch/child_process.py:children_by_role``: a process's live children per role they run,
from /proc (what ``up``'s autoscaling tests and ``bench_autoscale.py`` count workers by)."""

from __future__ import annotations

import os
import subprocess
import sys

from splitserve.launch.child_process import children_by_role

SLEEPER = "import time; time.sleep(30)"


def _child(*role_words: str) -> subprocess.Popen[bytes]:
    """A sleeping child whose command line carries ``role_words`` (as a role's would)."""
    return subprocess.Popen([sys.executable, "-c", SLEEPER, *role_words])


def test_children_are_counted_by_the_role_module_they_name_and_gone_ones_are_not() -> None:
    before = children_by_role(os.getpid())
    children = [
        _child("splitserve.decode.main"),
        _child("splitserve.decode.main", "--port=0"),
        _child("splitserve.prefill.main"),
        _child("splitserve.launch.dual_worker"),  # not a role's main module
        _child(),
    ]
    try:
        counts = children_by_role(os.getpid())
        assert counts["decode"] - before["decode"] == 2
        assert counts["prefill"] - before["prefill"] == 1
        assert sum(counts.values()) - sum(before.values()) == 3
        children[0].kill()
        children[0].wait()
        assert children_by_role(os.getpid())["decode"] - before["decode"] == 1
    finally:
        for child in children:
            child.kill()
            child.wait()
