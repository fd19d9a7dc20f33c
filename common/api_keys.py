"""API keys of the public plane: who may call, and which tenant each caller belongs to.

Keys come from ``--api-key KEY`` (repeatable), from a keys file (``--api-keys-file``: one key
per line, optionally followed by whitespace and the tenant's name; ``#`` starts a comment)
or from ``SPLITSERVE_API_KEYS`` (the file's format, for ``splitserve up`` to hand keys to its
children without putting them on a command line). A key without a tenant is a tenant of its
own, named ``key-<first 8 hex digits of its SHA-256>``.

Callers present a key as ``authorization: Bearer <key>`` (HTTP header or gRPC metadata, the
way the OpenAI SDK sends it). Keys are held only as SHA-256 digests and a presented key is
looked up by its digest, so neither the keys nor the time a lookup takes say anything about
them. An empty ``ApiKeys`` admits everyone (anonymous callers), as ``make serve`` on
localhost does by default.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from splitserve.common.env_flags import (
    built_or_exit,
    env_default,
    env_name,
    truthy,
)
from splitserve.common.settings import add_settings_args, setting

KEYS_ENV = env_name("--api-keys")
BEARER = "bearer "


@dataclass(frozen=True)
class Caller:
    """Who made a call: the tenant, and which key (its digest; never the key itself)."""

    tenant: str
    key_digest: str
    """Hex SHA-256 of the key; '' for an anonymous caller (no keys configured)."""


ANONYMOUS = Caller(tenant="", key_digest="")


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeys:
    """The accepted keys and their tenants (empty: no key needed)."""

    def __init__(self, tenants_by_key: Mapping[str, str | None] = {}) -> None:  # noqa: B006
        """``tenants_by_key``: key -> tenant name (None: the key's own tenant)."""
        self._callers: dict[str, Caller] = {}
        for key, tenant in tenants_by_key.items():
            if not key or any(c.isspace() for c in key):
                raise ValueError("an API key must be non-empty, without spaces")
            if tenant is not None and (not tenant or any(c.isspace() for c in tenant)):
                raise ValueError("a tenant name must be non-empty, without spaces")
            digest = _digest(key)
            self._callers[digest] = Caller(tenant or f"key-{digest[:8]}", digest)

    @property
    def required(self) -> bool:
        return bool(self._callers)

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(caller.tenant for caller in self._callers.values())

    def caller_of(self, authorization: str | None) -> Caller | None:
        """The caller an ``authorization`` header value names (``Bearer <key>``, the scheme in
        any case); None when keys are required and it names none of them; ``ANONYMOUS`` when
        no key is required."""
        if not self.required:
            return ANONYMOUS
        if authorization is None or not authorization.lower().startswith(BEARER):
            return None
        return self._callers.get(_digest(authorization[len(BEARER) :].strip()))

    @classmethod
    def parse(cls, lines: Iterable[str], flag_keys: Iterable[str] = ()) -> ApiKeys:
        """Keys from keys-file ``lines`` and bare ``flag_keys``; ``ValueError`` naming the line
        of a malformed entry or a key given twice."""
        tenants: dict[str, str | None] = {}

        def add(key: str, tenant: str | None, where: str) -> None:
            if key in tenants:
                raise ValueError(f"{where}: this API key is listed twice")
            tenants[key] = tenant

        for number, line in enumerate(lines, 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) > 2:
                raise ValueError(f"API keys line {number}: expected '<key> [<tenant>]'")
            add(fields[0], fields[1] if len(fields) == 2 else None, f"API keys line {number}")
        for key in flag_keys:
            add(key, None, "--api-key")
        return cls(tenants)


@dataclass(frozen=True)
class ApiKeySettings:
    """The API keys a public port asks for (a settings group: ``common/settings.py``)."""

    api_key: tuple[str, ...] = setting(
        (),
        "an API key callers must present (visible in the process list: prefer "
        f"--api-keys-file or {KEYS_ENV}, one '<key> [<tenant>]' per line)",
        env=False,
    )
    api_keys_file: Path | None = setting(
        None, "file of API keys, one '<key> [<tenant>]' per line; with none, no key is needed"
    )


def add_api_key_args(
    parser: argparse._ActionsContainer, env: Mapping[str, str] = os.environ
) -> None:
    """``--api-key`` (repeatable) and ``--api-keys-file`` (env ``SPLITSERVE_API_KEYS_FILE``;
    keys in the file's format also from ``SPLITSERVE_API_KEYS``)."""
    add_settings_args(parser, ApiKeySettings, env)


def add_health_needs_key_flag(
    parser: argparse._ActionsContainer, what: str, env: Mapping[str, str] = os.environ
) -> None:
    """``--health-needs-key``: ``what`` (health, metrics) asks for an API key too."""
    parser.add_argument(
        "--health-needs-key",
        action="store_true",
        default=env_default("--health-needs-key", False, truthy, env),
        help=f"with API keys, {what} need a key too (default: open, for probes; env "
        f"{env_name('--health-needs-key')}=1)",
    )


def api_keys_from_args(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> ApiKeys:
    """The keys of the flags, the keys file and ``SPLITSERVE_API_KEYS`` together."""
    lines = env.get(KEYS_ENV, "").splitlines()
    if args.api_keys_file is not None:
        lines += Path(args.api_keys_file).read_text().splitlines()
    return ApiKeys.parse(lines, args.api_key)


def api_keys_or_exit(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ApiKeys:
    """``api_keys_from_args``, or the parser's usage error (exit status 2) saying what is wrong."""
    return built_or_exit(parser, lambda: api_keys_from_args(args))
