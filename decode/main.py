"""``splitserve decode``: a decode worker process (see ``worker/runtime.py`` for its life)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from splitserve.common.membership import Role
from splitserve.decode.servicer import DecodeServicer
from splitserve.decode.worker import DecodeWorker
from splitserve.proto.splitserve.v1 import worker_pb2, worker_pb2_grpc
from splitserve.worker.runtime import WorkerRole, worker_main

DECODE_ROLE = WorkerRole(
    name="decode",
    role=Role.DECODE,
    service_name=worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name,
    make_servicer=DecodeServicer,
    add_servicer=worker_pb2_grpc.add_DecodeWorkerServicer_to_server,
    make_domain=DecodeWorker,
)


def main(argv: Sequence[str] | None = None) -> int:
    return worker_main([DECODE_ROLE], argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
