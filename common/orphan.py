"""A child of ``splitserve up`` stops when ``up`` is gone, however it went (SIGKILL included).

``up`` puts its pid in each child's environment (``PARENT_PID_ENV``). ``stop_when_orphaned``
starts a daemon thread that checks every ``interval_s`` whether this process's parent is still
that pid; once it is not (the kernel reparented us: ``up`` died without stopping its
children), it sends this process SIGTERM, so the role drains and exits as on any SIGTERM.
Without the variable (a role started on its own, by systemd or Kubernetes) it does nothing.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Mapping

PARENT_PID_ENV = "SPLITSERVE_PARENT_PID"
CHECK_INTERVAL_S = 1.0


def stop_when_orphaned(
    env: Mapping[str, str] = os.environ, interval_s: float = CHECK_INTERVAL_S
) -> threading.Thread | None:
    """Start the watch when ``env`` names a parent; the thread, or None without one."""
    raw = env.get(PARENT_PID_ENV)
    if not raw:
        return None
    parent = int(raw)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name="stop when orphaned", daemon=True)
    thread.start()
    return thread
