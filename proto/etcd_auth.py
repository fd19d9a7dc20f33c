"""etcd's user/password auth as its client sees it: the login (``EtcdLogin``), the token it
earns (``TokenKeeper``) and what etcd's refusals say about auth (``refusal_of``).

etcd with auth enabled answers a call only when it carries a token as call metadata
``token``; ``Auth.Authenticate`` (user name and password) hands one out. etcd forgets a
token on its own: a simple token after ``--auth-token-ttl`` seconds unused (300 by default)
and whenever etcd restarts, a JWT at its expiry. A forgotten token is refused
UNAUTHENTICATED ("invalid auth token") on a unary call, and a watch created with one is
cancelled "permission denied", the same answer as for a user without the right: a client
tells the two apart by logging in again once.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from splitserve.proto.etcd import rpc_pb2

TOKEN_METADATA_KEY = "token"
"""The call metadata key etcd reads the token from."""


@dataclass(frozen=True)
class EtcdLogin:
    """An etcd user and its password (``repr`` never shows the password)."""

    user: str
    password: str = field(repr=False)

    def __post_init__(self) -> None:
        if not self.user or not self.password:
            raise ValueError("an etcd login needs a user name and a password")

    def request(self) -> rpc_pb2.AuthenticateRequest:
        return rpc_pb2.AuthenticateRequest(name=self.user, password=self.password)


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries ``token``; none without one."""
    return () if token is None else ((TOKEN_METADATA_KEY, token),)


class Refusal(enum.Enum):
    """What an etcd refusal says about auth."""

    STALE_TOKEN = "stale token"
    """The token sent is unknown (expired, or etcd restarted) or older than the auth store:
    log in again and retry."""
    NO_USER = "no user"
    """The call carried no token and etcd has auth enabled."""
    BAD_LOGIN = "bad login"
    """``Authenticate`` refused the user name or password."""
    DENIED = "denied"
    """The user's roles do not cover the keys the call touches."""
    NOT_ENABLED = "not enabled"
    """``Authenticate`` on an etcd whose auth is off: calls need no token."""


_REFUSALS = (
    ("invalid auth token", Refusal.STALE_TOKEN),
    ("revision of auth store is old", Refusal.STALE_TOKEN),
    ("user name is empty", Refusal.NO_USER),
    ("authentication failed", Refusal.BAD_LOGIN),
    ("permission denied", Refusal.DENIED),
    ("authentication is not enabled", Refusal.NOT_ENABLED),
)
"""etcd's error texts (``etcdserver: ...``; a cancelled watch's reason quotes them too)."""


def refusal_of(code: grpc.StatusCode | None, details: str) -> Refusal | None:
    """The auth refusal a call's status (or a watch's cancel reason, ``code`` None) stands
    for; None when it is about something else."""
    for text, refusal in _REFUSALS:
        if text in details:
            return refusal
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return Refusal.STALE_TOKEN
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return Refusal.DENIED
    return None


class TokenKeeper:
    """The current token of one login, shared by every call of one client.

    ``token()`` logs in (``log_in``: the ``Authenticate`` call; it returns None where etcd
    has auth off) on first use and again after ``forget``; callers arriving meanwhile wait
    for that one login. Errors of ``log_in`` reach the caller and leave no token behind,
    so the next ``token()`` tries again. Use from one event loop.
    """

    def __init__(self, log_in: Callable[[], Awaitable[str | None]]) -> None:
        self._log_in = log_in
        self._token: str | None = None
        self._valid = False
        self._lock = asyncio.Lock()

    async def token(self) -> str | None:
        if not self._valid:
            async with self._lock:
                if not self._valid:
                    self._token = await self._log_in()
                    self._valid = True
        return self._token

    def forget(self, token: str | None) -> None:
        """etcd refused ``token`` as stale (or asked for one where ``token`` is None): the
        next ``token()`` logs in again. A no-op when another caller already replaced it."""
        if self._valid and token == self._token:
            self._valid = False
