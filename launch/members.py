"""Wait until a coordinator routes to every worker ``splitserve up`` started.

A worker prints its ready line before it registers (or announces itself on etcd), and a
coordinator turns SERVING with its first decode worker; a request sent in between is placed
without the workers still on their way in (a prompt computed on its decode worker because
the prefill worker was not routable yet). ``wait_for_members`` closes that gap: it asks the
coordinator's internal port (``proto/membership_client.py:MembershipClient``, with the cluster
credential) until every expected member is routable (registered, dialled back, healthy).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Collection

from splitserve.common.errors import SplitserveError
from splitserve.proto.cluster_auth import ClusterCredential
from splitserve.proto.membership_client import MembershipClient
from splitserve.proto.server import open_channel
from splitserve.proto.tls import TlsConfig

POLL_S = 0.1
CALL_TIMEOUT_S = 1.0


async def wait_for_members(
    internal_address: str,
    worker_ids: Collection[str],
    timeout_s: float,
    credential: ClusterCredential,
    tls: TlsConfig | None = None,
) -> None:
    """Return once the coordinator at ``internal_address`` has listed each of ``worker_ids``
    as routable; ``TimeoutError`` naming the missing ones after ``timeout_s``."""
    missing = set(worker_ids)
    async with open_channel(internal_address, tls) as channel:
        client = MembershipClient(channel, credential)
        try:
            async with asyncio.timeout(timeout_s):
                while missing:
                    with contextlib.suppress(SplitserveError):  # not answering yet
                        missing -= await client.routable_members(CALL_TIMEOUT_S)
                    if missing:
                        await asyncio.sleep(POLL_S)
        except TimeoutError:
            raise TimeoutError(
                f"the coordinator at {internal_address} does not route to "
                f"{', '.join(sorted(missing))} after {timeout_s:.0f} s"
            ) from None
