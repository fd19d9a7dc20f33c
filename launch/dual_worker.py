"""``splitserve worker --roles prefill,decode``: one worker process serving several roles on one
engine (a dual-role worker; see ``worker/runtime.py`` for its life).

A dual-role worker is a decode worker that also takes the prefill worker's ``Prefill`` calls:
it registers twice at one address, as ``<id>-prefill`` and ``<id>-decode``. Coordinators
decode requests on it, compute prompts there for other decode workers (its engine chunks
them into its decode batch), and never send it a prompt to push to itself: a request
decoding here is prefilled here directly (``coordinator/router.py:Router``), with no
transfer. So no core of a machine idles while the other phase queues.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Sequence

# In launch/, not worker/: it composes the prefill and decode roles, both built on worker/
# (the folder order of docs/architecture.md, checked by tests/test_architecture.py).
from splitserve.common.env_flags import comma_separated
from splitserve.decode.main import DECODE_ROLE
from splitserve.prefill.main import PREFILL_ROLE
from splitserve.prefill.worker import PrefillWorker
from splitserve.worker.runtime import WorkerRole, worker_main

ROLES_FLAG = "--roles"


def roles_of(text: str) -> list[WorkerRole]:
    """ "prefill,decode" -> the roles, in a fixed order; raises ``ValueError`` for an unknown,
    repeated or empty list."""
    names = comma_separated(text)
    known = {"prefill": PREFILL_ROLE, "decode": DECODE_ROLE}
    unknown = [name for name in names if name not in known]
    if unknown or not names or len(set(names)) != len(names):
        raise ValueError(f"--roles takes prefill, decode or prefill,decode, not {text!r}")
    if len(names) == 1:
        return [known[names[0]]]
    shared_prefill = dataclasses.replace(
        PREFILL_ROLE, make_domain=functools.partial(PrefillWorker, engine_shared=True)
    )
    return [shared_prefill, DECODE_ROLE]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    picker = argparse.ArgumentParser(add_help=False)
    picker.add_argument(ROLES_FLAG, default="prefill,decode")
    known, _ = picker.parse_known_args(argv)
    try:
        roles = roles_of(known.roles)
    except ValueError as error:
        print(f"splitserve worker: error: {error}", file=sys.stderr)
        return 2
    return worker_main(roles, argv, __doc__, command="worker")


if __name__ == "__main__":
    sys.exit(main())
