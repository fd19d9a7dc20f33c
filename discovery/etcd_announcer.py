"""A worker's announcement in etcd: its info under a lease that it keeps alive.

``EtcdAnnouncer.announce`` grants a lease of ``ttl_s`` seconds, puts the worker's key under
it, and keeps the lease alive every ttl/3 in a background task. When etcd says the lease is
gone (an outage longer than the TTL while etcd itself kept running, or a revocation by
someone else) the task grants a new lease and puts the key again, retrying until etcd
answers. ``withdraw`` stops that and revokes the lease: etcd deletes the key at once and
every watcher sees the worker leave. A worker that dies simply stops the keep-alives; its
key goes with the lease within ``ttl_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from splitserve.common.membership import WorkerInfo
from splitserve.discovery.etcd_keys import worker_key
from splitserve.proto import convert
from splitserve.proto.etcd_client import EtcdClient, EtcdError, Lease, LeaseNotFound

logger = logging.getLogger(__name__)

DEFAULT_TTL_S = 10
"""A dead worker leaves every watcher's membership within this many seconds."""
REPUBLISH_RETRY_S = 0.5


class EtcdAnnouncer:
    """``discovery.Announcer`` on etcd; one worker, one announcement."""

    def __init__(self, client: EtcdClient, cluster: str, ttl_s: int = DEFAULT_TTL_S) -> None:
        self._client = client
        self._cluster = cluster
        self._ttl_s = ttl_s
        self._lease: Lease | None = None
        """The newest lease granted; revoked by ``withdraw`` whatever the task is doing."""
        self._task: asyncio.Task[None] | None = None

    async def announce(self, info: WorkerInfo) -> None:
        """Publish ``info``; returns once it is in etcd. Raises ``EtcdError`` (nothing left
        behind but a lease that expires) when etcd does not take it."""
        if self._task is not None:
            raise RuntimeError(f"worker {info.worker_id} is already announced")
        key = worker_key(self._cluster, info.worker_id)
        value = convert.worker_info_to_bytes(info)
        lease = await self._publish(key, value)
        self._task = asyncio.create_task(
            self._keep_published(key, value, lease), name=f"etcd-announce-{info.worker_id}"
        )

    async def _publish(self, key: bytes, value: bytes) -> Lease:
        lease = await self._client.grant_lease(self._ttl_s)
        self._lease = lease
        await self._client.put(key, value, lease)
        return lease

    async def _keep_published(self, key: bytes, value: bytes, lease: Lease) -> None:
        while True:
            try:
                await self._client.keep_alive(lease)
                logger.warning("etcd lease of %s lost; announcing again", key.decode())
            except Exception:  # a bug must not end the announcement for good
                logger.exception("etcd keep-alive of %s failed; announcing again", key.decode())
                await asyncio.sleep(REPUBLISH_RETRY_S)
            while True:
                try:
                    lease = await self._publish(key, value)
                    break
                except EtcdError as error:
                    logger.info("announcing %s again failed (%s); retrying", key.decode(), error)
                    await asyncio.sleep(REPUBLISH_RETRY_S)

    async def withdraw(self) -> None:
        """Stop the keep-alives and revoke the lease; the key is gone when this returns, or,
        etcd being unreachable, within ``ttl_s``. Idempotent."""
        task, self._task = self._task, None
        lease, self._lease = self._lease, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if lease is None:
            return
        try:
            await self._client.revoke(lease)
        except LeaseNotFound:
            pass
        except EtcdError as error:
            logger.warning("could not revoke the etcd lease (%s): it expires by itself", error)
