"""Wait until the coordinators route to every worker ``splitserve up`` started.

A worker prints its ready line before it registers (or announces itself on etcd), and a
coordinator turns SERVING with its first decode worker; a request sent in between is placed
without the workers still on their way in (a prompt computed on its decode worker because
the prefill worker was not routable yet). ``wait_for_members`` closes that gap: it asks each
coordinator's internal port (``proto/membership_client.py:MembershipClient``, with the cluster
credential) until each has listed every expected member as routable (registered, dialled
back, healthy, circuit closed) at least once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence

from splitserve.common.errors import SplitserveError
from splitserve.proto.cluster_auth import ClusterCredential
from splitserve.proto.membership_client import MembershipClient
from splitserve.proto.server import open_channel
from splitserve.proto.tls import TlsConfig

POLL_S = 0.1
"""Between two ``ListWorkers`` calls to a coordinator that lacks some member."""
CALL_TIMEOUT_S = 1.0
"""Deadline of one ``ListWorkers`` call."""


async def wait_for_members(
    internal_addresses: Sequence[str],
    worker_ids: Collection[str],
    timeout_s: float,
    credential: ClusterCredential,
    tls: TlsConfig | None = None,
) -> None:
    """Return once every coordinator (its internal address) has listed each of
    ``worker_ids`` as routable; ``TimeoutError`` after ``timeout_s`` in all, naming what
    each coordinator still lacks and the last error its calls met."""
    waits = [_Wait(address, set(worker_ids)) for address in internal_addresses]
    try:
        async with asyncio.timeout(timeout_s):
            await asyncio.gather(*(wait.run(credential, tls) for wait in waits))
    except TimeoutError:
        lacking = "; ".join(wait.describe() for wait in waits if wait.missing)
        raise TimeoutError(f"after {timeout_s:.0f} s, {lacking}") from None


class _Wait:
    """One coordinator's wait: the members it has not listed as routable yet."""

    def __init__(self, address: str, missing: set[str]) -> None:
        self.address = address
        self.missing = missing
        self.last_error: SplitserveError | None = None

    async def run(self, credential: ClusterCredential, tls: TlsConfig | None) -> None:
        async with open_channel(self.address, tls) as channel:
            client = MembershipClient(channel, credential)
            while self.missing:
                try:
                    self.missing -= await client.routable_members(CALL_TIMEOUT_S)
                except SplitserveError as error:  # not answering yet, or refusing: kept
                    self.last_error = error
                if self.missing:
                    await asyncio.sleep(POLL_S)

    def describe(self) -> str:
        said = f" (last error: {self.last_error})" if self.last_error is not None else ""
        missing = ", ".join(sorted(self.missing))
        return f"the coordinator at {self.address} does not route to {missing}{said}"
