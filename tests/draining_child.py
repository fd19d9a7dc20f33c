"""A child process for launcher tests: starts a thread of its own (as a worker's engine does),
announces itself ready (``test ready at <pid>``), then on SIGTERM takes ``DRAIN_S`` to finish
(as a worker draining its requests) and exits 0."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

DRAIN_S = 0.3


def main() -> None:
    def drain(_signum: int, _frame: object) -> None:
        time.sleep(DRAIN_S)
        sys.exit(0)

    signal.signal(signal.SIGTERM, drain)
    threading.Thread(target=time.sleep, args=(3600,), name="engine", daemon=True).start()
    print(f"test ready at pid:{os.getpid()}", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
