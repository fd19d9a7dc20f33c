"""What each tenant (an API key's tenant: ``common/api_keys.py``) may use: its share of the
admission queue (weight), its concurrent requests, its tokens per minute, the highest
priority its requests may ask for, and whether its prompts' cached KV is its own.

Every tenant gets ``TenantPolicy.default``; a tenants file (TOML, ``--tenants-file``) may
override it per tenant::

    [default]
    max_inflight = 64          # requests admitted or waiting at once; 0: no limit
    tokens_per_minute = 0      # prompt + max_tokens, refunded what was not generated; 0: none
    weight = 1.0               # share of the queue when tenants compete
    max_priority = 0           # the highest priority a request may ask for
    private_prefix_cache = false   # true: cached KV shared only among the tenant's requests

    [tenants.acme]
    weight = 4.0
    max_priority = 10

Anonymous callers (no API keys configured) are one tenant, "".
"""

from __future__ import annotations

import dataclasses
import math
import time
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitserve.common.errors import InvalidRequestError

LIMIT_FIELDS = (
    "max_inflight",
    "tokens_per_minute",
    "weight",
    "max_priority",
    "private_prefix_cache",
)


@dataclass(frozen=True)
class TenantLimits:
    max_inflight: int = 0
    """Requests admitted or waiting at once; 0: no limit."""
    tokens_per_minute: int = 0
    """Tokens (prompt + max_tokens at admission, unused output refunded) per minute; 0: none."""
    weight: float = 1.0
    """Share of admission when tenants compete (weighted fair queuing)."""
    max_priority: int = 0
    """The highest priority a request may ask for (higher: admitted sooner)."""
    private_prefix_cache: bool = False
    """Whether the tenant's requests share cached KV only among themselves: the coordinator
    salts each with the tenant's name (``tenant_cache_salt``), under the request's own
    ``cache_salt``, so no other tenant's request is ever served (or timed) from its
    prompts' blocks."""

    def __post_init__(self) -> None:
        if not isinstance(self.private_prefix_cache, bool):
            raise ValueError("private_prefix_cache must be true or false")
        if self.max_inflight < 0 or self.tokens_per_minute < 0:
            raise ValueError("max_inflight and tokens_per_minute must be >= 0")
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ValueError("weight must be a positive number")


@dataclass(frozen=True)
class TenantPolicy:
    default: TenantLimits = TenantLimits()
    overrides: Mapping[str, TenantLimits] = field(default_factory=dict)

    def limits(self, tenant: str) -> TenantLimits:
        return self.overrides.get(tenant, self.default)

    @classmethod
    def from_toml(cls, path: Path, default: TenantLimits = TenantLimits()) -> TenantPolicy:
        """The file's ``[default]`` over ``default`` (the flags), then its ``[tenants.<name>]``
        over that; ``ValueError`` naming the table of an unknown key or a bad value."""
        document = tomllib.loads(path.read_text())
        unknown = set(document) - {"default", "tenants"}
        if unknown:
            raise ValueError(f"{path}: unknown tables {sorted(unknown)}")
        base = _limits(default, document.get("default", {}), "[default]")
        overrides = {
            name: _limits(base, table, f"[tenants.{name}]")
            for name, table in document.get("tenants", {}).items()
        }
        return cls(base, overrides)


def _limits(base: TenantLimits, table: Mapping[str, Any], where: str) -> TenantLimits:
    unknown = set(table) - set(LIMIT_FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; known: {LIMIT_FIELDS}")
    try:
        return dataclasses.replace(base, **table)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from error


class TokenBucket:
    """Tokens per minute: holds up to one minute's worth, refills continuously."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = per_minute
        self._rate_per_s = per_minute / 60.0
        self._clock = clock
        self._level = float(per_minute)
        self._at = clock()

    def _refill(self) -> None:
        now = self._clock()
        self._level = min(self.capacity, self._level + (now - self._at) * self._rate_per_s)
        self._at = now

    def wait_s(self, tokens: int) -> float:
        """Seconds until ``tokens`` can be taken; 0: now."""
        self._refill()
        return max(0.0, (tokens - self._level) / self._rate_per_s)

    def take(self, tokens: int) -> None:
        self._refill()
        self._level -= tokens

    def give_back(self, tokens: int) -> None:
        self._refill()
        self._level = min(self.capacity, self._level + tokens)


TENANT_SALT_MARK = "\x00"
"""What starts every tenant's salt and no salt a caller may send (``check_public_salt``)."""


def check_public_salt(cache_salt: str) -> None:
    """Refuse (``InvalidRequestError`` naming ``cache_salt``) a caller's salt holding
    ``TENANT_SALT_MARK``: it could name a tenant's private namespace."""
    if TENANT_SALT_MARK in cache_salt:
        raise InvalidRequestError("cache_salt must not hold NUL characters", "cache_salt")


def tenant_cache_salt(tenant: str, cache_salt: str) -> str:
    """The salt of a request of ``tenant`` (with a private prefix cache) that asked for
    ``cache_salt`` (checked by ``check_public_salt``): one no caller's salt can equal, and no
    other tenant's (the tenant's name ends at the second mark)."""
    return f"{TENANT_SALT_MARK}{tenant}{TENANT_SALT_MARK}{cache_salt}"
