"""``splitserve prefill``: a prefill worker process (see ``worker/runtime.py`` for its life)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from splitserve.common.membership import Role
from splitserve.prefill.servicer import PrefillServicer
from splitserve.prefill.worker import PrefillWorker
from splitserve.proto.splitserve.v1 import worker_pb2, worker_pb2_grpc
from splitserve.worker.runtime import WorkerRole, worker_main

PREFILL_ROLE = WorkerRole(
    name="prefill",
    role=Role.PREFILL,
    service_name=worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name,
    make_servicer=PrefillServicer,
    add_servicer=worker_pb2_grpc.add_PrefillWorkerServicer_to_server,
    make_domain=PrefillWorker,
)


def main(argv: Sequence[str] | None = None) -> int:
    return worker_main([PREFILL_ROLE], argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
