"""A minimal asyncio client of etcd v3 over gRPC: keys, leases and a prefix watch.

The only code that builds or reads etcd's proto messages (``proto/etcd/*.proto``, our own
wire-compatible subset of etcd's API); callers get plain values: ``KeyValue``, ``Lease`` and
the watch events ``PutEvent``, ``DeleteEvent`` and ``ResetEvent``. Keys and values are bytes.

Failures: a call no endpoint answers in time raises ``EtcdUnavailable`` (retry later);
``LeaseNotFound`` when etcd no longer knows a lease; ``EtcdAuthError`` when etcd refuses the
client's login or rights (no user where etcd has auth enabled, a wrong password, keys outside
the user's roles); ``EtcdError`` for anything else. The long-lived operations never raise on
unavailability: ``keep_alive`` and ``watch_prefix`` retry with a capped backoff, trying the
next endpoint each time, until cancelled.

Security: ``credentials`` (``grpc.ssl_channel_credentials(...)``) turns on TLS, with a client
certificate when they hold one (etcd's ``--client-cert-auth``). ``login`` (``EtcdLogin``,
``proto/etcd_auth.py``) logs in to an etcd with auth enabled: the first call asks
``Authenticate`` for a token, and every call, streams included, carries it as call metadata
``token``. When etcd no longer knows the token (it expired, or etcd restarted) the client logs
in again and retries the call once; a watch cancelled "permission denied" is reopened once
after a fresh login, which tells a forgotten token from a user without the right. etcd with
auth off answers ``Authenticate`` "not enabled": the client then calls without a token.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from splitserve.common.errors import MembershipStoreError
from splitserve.proto.etcd import kv_pb2, rpc_pb2, rpc_pb2_grpc
from splitserve.proto.etcd_auth import EtcdLogin, Refusal, TokenKeeper, refusal_of, token_metadata

logger = logging.getLogger(__name__)

CHANNEL_OPTIONS = (
    # etcd refuses pings more often than every 5 s, and any ping without a call in flight.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
    # Reconnect within a second of an etcd member coming back (gRPC's default waits minutes).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
)
REQUIRE_LEADER = (("hasleader", "true"),)
"""Stream metadata: a member cut off from its cluster's leader ends the stream (instead of
keeping it silent), so the client moves to another endpoint."""
_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_LEASE_NOT_FOUND = "requested lease not found"
_STREAM_BROKE = (grpc.aio.AioRpcError, asyncio.InvalidStateError, TimeoutError)
"""How a stream call fails: an RPC error, a write on a call that already ended, no reply."""


def _raise_if_cancelled() -> None:
    """Re-raise a cancellation of the running task that a stream call turned into one of
    ``_STREAM_BROKE`` (grpc.aio may end a cancelled read as a CANCELLED ``AioRpcError``):
    a retry loop that caught it would otherwise go on for good, and whoever cancelled it
    (``EtcdAnnouncer.withdraw``, a watcher's close) would wait on it forever."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


MIN_RETRY_S = 0.1
MAX_RETRY_S = 1.0


class EtcdError(MembershipStoreError):
    """etcd refused a call (or answered something this client cannot use)."""


class EtcdUnavailable(EtcdError):
    """No endpoint answered in time; the same call may succeed later."""


class LeaseNotFound(EtcdError):
    """etcd does not know the lease: it expired or was revoked."""


class EtcdAuthError(EtcdError):
    """etcd refused the client's login or rights: a call without a user where etcd has auth
    enabled, a wrong user name or password, or keys outside the user's roles."""


class _StaleToken(EtcdAuthError):
    """etcd no longer knows the token the call carried; ``_unary`` logs in again and retries."""


class _AuthNotEnabled(EtcdError):
    """``Authenticate`` on an etcd with auth off."""


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    mod_revision: int
    """The store revision of the key's last change."""
    lease: int
    """The lease the key lives under; 0: none."""


@dataclass(frozen=True)
class Lease:
    id: int
    ttl_s: int
    """Time to live as etcd granted it (etcd may raise a short request to its minimum)."""


@dataclass(frozen=True)
class PutEvent:
    """``key`` was created or changed to ``value`` at ``revision``."""

    key: bytes
    value: bytes
    revision: int


@dataclass(frozen=True)
class DeleteEvent:
    """``key`` was deleted at ``revision``: by a call, or with its expired or revoked lease."""

    key: bytes
    revision: int


@dataclass(frozen=True)
class ResetEvent:
    """Events were lost (etcd compacted past the watch's position): ``items`` is the whole
    prefix as of ``revision``; forget everything known before and start over from it."""

    items: tuple[KeyValue, ...]
    revision: int


WatchEvent = PutEvent | DeleteEvent | ResetEvent


def prefix_end(prefix: bytes) -> bytes:
    """The range end that makes [prefix, end) exactly the keys starting with ``prefix``."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\0"  # every key >= prefix
    return stripped[:-1] + bytes([stripped[-1] + 1])


class _Backoff:
    """Waits between retries: MIN_RETRY_S, doubling to MAX_RETRY_S; ``reset`` after success."""

    def __init__(self) -> None:
        self._delay_s = MIN_RETRY_S

    def reset(self) -> None:
        self._delay_s = MIN_RETRY_S

    async def wait(self) -> None:
        await asyncio.sleep(self._delay_s)
        self._delay_s = min(self._delay_s * 2, MAX_RETRY_S)


def _error_from_rpc(error: grpc.aio.AioRpcError, login: EtcdLogin | None) -> EtcdError:
    details = error.details() or ""
    if error.code() in _TRANSIENT:
        return EtcdUnavailable(f"etcd unavailable: {error.code().name}: {details}")
    if _LEASE_NOT_FOUND in details:
        return LeaseNotFound(details)
    refusal = refusal_of(error.code(), details)
    if refusal is not None:
        return _auth_error(refusal, details, login)
    return EtcdError(f"etcd refused the call: {error.code().name}: {details}")


def _auth_error(refusal: Refusal, details: str, login: EtcdLogin | None) -> EtcdError:
    """The error an auth ``refusal`` of etcd (``details``: its words) raises."""
    user = None if login is None else login.user
    if refusal is Refusal.NOT_ENABLED:
        return _AuthNotEnabled(details)
    if refusal is Refusal.BAD_LOGIN:
        return EtcdAuthError(f"etcd auth: login as {user!r} refused ({details})")
    if refusal is Refusal.DENIED:
        return EtcdAuthError(
            f"etcd auth: user {user!r} may not touch these keys ({details}): grant one of its "
            "roles readwrite on the cluster's prefix"
        )
    if refusal is Refusal.NO_USER and login is None:
        return EtcdAuthError(
            f"etcd auth: etcd requires a user ({details}): log in with an etcd user and its "
            "password (--etcd-user and SPLITSERVE_ETCD_PASSWORD or --etcd-password-file)"
        )
    return _StaleToken(f"etcd auth: etcd refused the token of user {user!r} ({details})")


class _Connection:
    """One endpoint's channel and the four service stubs on it."""

    def __init__(self, endpoint: str, credentials: grpc.ChannelCredentials | None) -> None:
        if credentials is None:
            self.channel = grpc.aio.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
        else:
            self.channel = grpc.aio.secure_channel(endpoint, credentials, options=CHANNEL_OPTIONS)
        self.kv = rpc_pb2_grpc.KVStub(self.channel)
        self.lease = rpc_pb2_grpc.LeaseStub(self.channel)
        self.watch = rpc_pb2_grpc.WatchStub(self.channel)
        self.auth = rpc_pb2_grpc.AuthStub(self.channel)


class EtcdClient:
    """Calls one etcd cluster through ``endpoints`` ("host:port" of its members), using one
    at a time and moving to the next when it stops answering.

    Every unary call is bounded by ``timeout_s`` per endpoint tried. ``credentials``: TLS
    (see the module docstring); ``login``: the etcd user to log in as. Use from one event
    loop; ``close()`` at the end (or ``async with``).
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        credentials: grpc.ChannelCredentials | None = None,
        login: EtcdLogin | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        if not endpoints:
            raise ValueError("EtcdClient needs at least one endpoint")
        self._endpoints = tuple(endpoints)
        self._credentials = credentials
        self._login = login
        self._tokens = None if login is None else TokenKeeper(self._log_in)
        self._timeout_s = timeout_s
        self._connections: dict[str, _Connection] = {}
        self._current = 0

    async def __aenter__(self) -> EtcdClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every channel; streams still open on them end with an error."""
        connections, self._connections = self._connections, {}
        for connection in connections.values():
            await connection.channel.close()

    def _connection(self) -> _Connection:
        endpoint = self._endpoints[self._current]
        if endpoint not in self._connections:
            self._connections[endpoint] = _Connection(endpoint, self._credentials)
        return self._connections[endpoint]

    def _fail_over(self) -> None:
        self._current = (self._current + 1) % len(self._endpoints)

    async def _token(self) -> str | None:
        """The token calls carry: None without a login (or where etcd has auth off)."""
        return None if self._tokens is None else await self._tokens.token()

    def _forget(self, token: str | None) -> None:
        if self._tokens is not None:
            self._tokens.forget(token)

    async def _log_in(self) -> str | None:
        """``Authenticate`` as ``login``: its token; None where etcd has auth off."""
        assert self._login is not None
        try:
            reply = await self._call(lambda c: c.auth.Authenticate, self._login.request(), None)
        except _AuthNotEnabled:
            logger.warning("etcd has auth off: calling it without logging in")
            return None
        logger.info("logged in to etcd as %s", self._login.user)
        return str(reply.token)

    async def _unary(self, method: Callable[[_Connection], Any], request: Any) -> Any:
        """``_call`` with the current token; when etcd refuses that token as stale, log in
        again and make the call once more."""
        token = await self._token()
        try:
            return await self._call(method, request, token)
        except _StaleToken:
            if self._tokens is None:
                raise
            logger.info("etcd refused the auth token; logging in again")
            self._forget(token)
            return await self._call(method, request, await self._token())

    async def _call(
        self, method: Callable[[_Connection], Any], request: Any, token: str | None
    ) -> Any:
        """``method(connection)(request)`` carrying ``token`` on the current endpoint, then on
        each other one while they are unavailable. Endpoints that are not connected fail at
        once, except the last one tried, which may take the whole ``timeout_s`` to
        (re)connect: a lone etcd coming back within the timeout answers the call."""
        error: grpc.aio.AioRpcError | None = None
        metadata = token_metadata(token)
        for attempt in range(len(self._endpoints)):
            last = attempt == len(self._endpoints) - 1
            try:
                return await method(self._connection())(
                    request, timeout=self._timeout_s, metadata=metadata, wait_for_ready=last
                )
            except grpc.aio.AioRpcError as rpc_error:
                if rpc_error.code() not in _TRANSIENT:
                    raise _error_from_rpc(rpc_error, self._login) from rpc_error
                error = rpc_error
                self._fail_over()
        assert error is not None
        raise _error_from_rpc(error, self._login) from error

    async def put(self, key: bytes, value: bytes, lease: Lease | None = None) -> int:
        """Set ``key`` (under ``lease``: deleted with it); returns the new store revision.
        ``LeaseNotFound`` when the lease is gone."""
        request = rpc_pb2.PutRequest(key=key, value=value, lease=lease.id if lease else 0)
        reply = await self._unary(lambda c: c.kv.Put, request)
        return int(reply.header.revision)

    async def put_if(
        self, key: bytes, value: bytes, expected: bytes | None, lease: Lease | None = None
    ) -> bool:
        """Set ``key`` (as ``put``) only if it holds ``expected`` now (None: it does not
        exist), in one transaction; whether it was set. ``LeaseNotFound`` as ``put``."""
        if expected is None:  # absent: no create revision yet
            compare = rpc_pb2.Compare(
                result=rpc_pb2.Compare.EQUAL,
                target=rpc_pb2.Compare.CREATE,
                key=key,
                create_revision=0,
            )
        else:
            compare = rpc_pb2.Compare(
                result=rpc_pb2.Compare.EQUAL, target=rpc_pb2.Compare.VALUE, key=key, value=expected
            )
        put = rpc_pb2.PutRequest(key=key, value=value, lease=lease.id if lease else 0)
        request = rpc_pb2.TxnRequest(
            compare=[compare], success=[rpc_pb2.RequestOp(request_put=put)]
        )
        reply = await self._unary(lambda c: c.kv.Txn, request)
        return bool(reply.succeeded)

    async def get_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        """Every key starting with ``prefix`` in key order, and the store revision they were
        read at (watch from revision + 1 to miss nothing after)."""
        request = rpc_pb2.RangeRequest(key=prefix, range_end=prefix_end(prefix))
        reply = await self._unary(lambda c: c.kv.Range, request)
        return [_key_value(kv) for kv in reply.kvs], int(reply.header.revision)

    async def get(self, key: bytes) -> KeyValue | None:
        """The key, or None when absent."""
        reply = await self._unary(lambda c: c.kv.Range, rpc_pb2.RangeRequest(key=key))
        return _key_value(reply.kvs[0]) if reply.kvs else None

    async def delete(self, key: bytes) -> int:
        """Delete ``key``; the store revision of the deletion, 0 (false) when it was absent."""
        reply = await self._unary(lambda c: c.kv.DeleteRange, rpc_pb2.DeleteRangeRequest(key=key))
        return int(reply.header.revision) if reply.deleted else 0

    async def grant_lease(self, ttl_s: int) -> Lease:
        """A new lease that expires ``ttl_s`` seconds after its last keep-alive."""
        reply = await self._unary(
            lambda c: c.lease.LeaseGrant, rpc_pb2.LeaseGrantRequest(TTL=ttl_s)
        )
        if reply.error:
            raise EtcdError(f"lease grant refused: {reply.error}")
        return Lease(id=int(reply.ID), ttl_s=int(reply.TTL))

    async def revoke(self, lease: Lease) -> None:
        """End the lease now: etcd deletes its keys at once (watchers see them deleted).
        ``LeaseNotFound`` when it had already ended."""
        await self._unary(lambda c: c.lease.LeaseRevoke, rpc_pb2.LeaseRevokeRequest(ID=lease.id))

    async def keep_alive(self, lease: Lease) -> None:
        """Refresh ``lease`` every ttl/3 until etcd reports it gone, then return.

        Runs until cancelled otherwise: a broken stream or an unreachable etcd is retried
        (next endpoint, capped backoff) without returning, since only etcd can tell whether
        the lease outlived the outage (a restarted etcd keeps its leases). A caller that
        must know the lease is alive watches for this coroutine's return. Raises
        ``EtcdAuthError`` when etcd refuses the login.
        """
        interval_s = max(lease.ttl_s / 3, 0.1)
        backoff = _Backoff()
        request = rpc_pb2.LeaseKeepAliveRequest(ID=lease.id)
        while True:
            call: grpc.aio.StreamStreamCall | None = None
            token: str | None = None
            try:
                token = await self._token()
                metadata = token_metadata(token) + REQUIRE_LEADER
                call = self._connection().lease.LeaseKeepAlive(metadata=metadata)
                while True:
                    await call.write(request)
                    async with asyncio.timeout(interval_s):
                        reply = await call.read()
                    if reply is grpc.aio.EOF:
                        break
                    if reply.TTL <= 0:
                        return
                    backoff.reset()
                    await asyncio.sleep(interval_s)
            except (*_STREAM_BROKE, EtcdUnavailable) as error:
                _raise_if_cancelled()
                self._forget_if_refused(token, error)
                logger.info("etcd lease keep-alive stream broke (%s); retrying", _brief(error))
            finally:
                if call is not None:
                    call.cancel()
            self._fail_over()
            await backoff.wait()

    async def watch_prefix(self, prefix: bytes, start_revision: int) -> AsyncGenerator[WatchEvent]:
        """Every change of a key under ``prefix`` from ``start_revision`` on, in revision
        order, each exactly once, until the consumer stops iterating.

        A broken stream is reopened (next endpoint, capped backoff) from the revision after
        the last one delivered, so an etcd outage only delays events. When etcd has
        compacted the revisions still to deliver, or its store is behind them (an etcd that
        came back with an empty or older data dir), the watch reads the prefix afresh and
        yields a ``ResetEvent`` with it, then continues after that read. (A replaced store
        that is already past the watch's position cannot be told apart.)

        A watch that etcd refuses ("permission denied": its token was forgotten, say by a
        restarted etcd) is reopened after logging in again; refused once more right after
        that login, or refused without a login, it raises ``EtcdAuthError``.
        """
        next_revision = start_revision
        backoff = _Backoff()
        logged_in_again = False  # the last refusal was answered so: another one raises
        while True:
            resynced = False
            call: grpc.aio.StreamStreamCall | None = None
            token: str | None = None
            try:
                token = await self._token()
                call = self._connection().watch.Watch(
                    metadata=token_metadata(token) + REQUIRE_LEADER
                )
                create = rpc_pb2.WatchCreateRequest(
                    key=prefix,
                    range_end=prefix_end(prefix),
                    start_revision=next_revision,
                    progress_notify=True,
                )
                await call.write(rpc_pb2.WatchRequest(create_request=create))
                while True:
                    reply = await call.read()
                    if reply is grpc.aio.EOF:
                        break
                    refusal = refusal_of(None, reply.cancel_reason) if reply.canceled else None
                    if refusal is not None:
                        if self._tokens is None or logged_in_again:
                            raise self._watch_refused(refusal, reply.cancel_reason)
                        logger.info("etcd refused the watch; logging in again")
                        self._forget(token)
                        logged_in_again = True
                        break
                    behind = reply.created and reply.header.revision + 1 < next_revision
                    if reply.compact_revision or behind:
                        items, revision = await self.get_prefix(prefix)
                        yield ResetEvent(tuple(items), revision)
                        next_revision = revision + 1
                        resynced = True
                        break
                    if reply.canceled:
                        logger.info("etcd cancelled the watch: %s", reply.cancel_reason)
                        break
                    backoff.reset()
                    logged_in_again = False
                    for event in reply.events:
                        yield _watch_event(event)
                    if reply.events:
                        next_revision = reply.events[-1].kv.mod_revision + 1
                    elif not reply.created:  # progress: nothing up to header.revision is left
                        next_revision = max(next_revision, reply.header.revision + 1)
            except (*_STREAM_BROKE, EtcdUnavailable) as error:
                _raise_if_cancelled()
                self._forget_if_refused(token, error)
                logger.info("etcd watch stream broke (%s); resuming", _brief(error))
            finally:
                if call is not None:
                    call.cancel()
            if not resynced:
                self._fail_over()
                await backoff.wait()

    def _forget_if_refused(self, token: str | None, error: BaseException) -> None:
        """A stream that etcd ended for its token: the next one logs in again."""
        if isinstance(error, grpc.aio.AioRpcError):
            refusal = refusal_of(error.code(), error.details() or "")
            if refusal in (Refusal.STALE_TOKEN, Refusal.NO_USER):
                self._forget(token)

    def _watch_refused(self, refusal: Refusal, reason: str) -> EtcdError:
        """The error of a watch etcd refused for good (``reason``: its cancel reason)."""
        if self._login is None:  # etcd says "permission denied" to a watch without a user
            refusal = Refusal.NO_USER
        return _auth_error(refusal, f"watch cancelled: {reason}", self._login)


def _brief(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return type(error).__name__


def _key_value(kv: kv_pb2.KeyValue) -> KeyValue:
    return KeyValue(
        key=bytes(kv.key), value=bytes(kv.value), mod_revision=int(kv.mod_revision), lease=kv.lease
    )


def _watch_event(event: kv_pb2.Event) -> PutEvent | DeleteEvent:
    if event.type == kv_pb2.Event.DELETE:
        return DeleteEvent(key=bytes(event.kv.key), revision=int(event.kv.mod_revision))
    return PutEvent(
        key=bytes(event.kv.key), value=bytes(event.kv.value), revision=int(event.kv.mod_revision)
    )
