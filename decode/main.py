"""``splitserve decode``: a decode worker process (see ``worker/runtime.py`` for its life)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from splitserve.decode.servicer import DecodeServicer
from splitserve.decode.worker import DecodeWorker
from splitserve.proto.server import serve_forever
from splitserve.proto.splitserve.v1 import worker_pb2, worker_pb2_grpc
from splitserve.worker.process import add_worker_args, apply_cpu_affinity
from splitserve.worker.runtime import WorkerRole, run_worker


async def _close(domain: DecodeWorker) -> None:
    domain.shutdown()


DECODE_ROLE = WorkerRole(
    name="decode",
    role=worker_pb2.WORKER_ROLE_DECODE,
    service_name=worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name,
    make_servicer=DecodeServicer,
    add_servicer=worker_pb2_grpc.add_DecodeWorkerServicer_to_server,
    make_domain=DecodeWorker,
    close_domain=_close,
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="splitserve decode", description=__doc__)
    add_worker_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s decode %(levelname)s %(message)s")
    apply_cpu_affinity(args)

    async def run(stop: asyncio.Event) -> None:
        await run_worker(args, DECODE_ROLE, stop)

    serve_forever(run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
