"""Command-line flags with ``SPLITSERVE_*`` environment twins, for every role's parser.

``--kv-cache-gib`` <-> ``SPLITSERVE_KV_CACHE_GIB``: a flag given on the command line wins over
the environment, which wins over the default.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from typing import TypeVar

T = TypeVar("T")


def env_name(flag: str) -> str:
    return "SPLITSERVE_" + flag.lstrip("-").replace("-", "_").upper()


def env_default(
    flag: str, default: object, convert: Callable[[str], object], env: Mapping[str, str]
) -> object:
    raw = env.get(env_name(flag))
    return default if raw is None else convert(raw)


def truthy(raw: str) -> bool:
    return raw.strip().lower() in ("1", "true", "yes", "on")


def add_env_flag(
    group: argparse._ActionsContainer,
    name: str,
    default: object,
    convert: Callable[[str], object],
    help_text: str,
    env: Mapping[str, str] = os.environ,
) -> None:
    """A ``--flag`` whose default comes from its ``SPLITSERVE_*`` twin when that is set."""
    group.add_argument(
        name,
        type=convert,
        default=env_default(name, default, convert, env),
        help=f"{help_text} (env {env_name(name)})",
    )


def comma_separated(raw: str) -> list[str]:
    """The items of a comma-separated flag value, stripped, empty ones dropped."""
    return [item.strip() for item in raw.split(",") if item.strip()]


def built_or_exit(parser: argparse.ArgumentParser, build: Callable[[], T]) -> T:
    """``build()`` (what some flags name: a credential, TLS files, API keys), or the parser's
    usage error (exit status 2) with its ``ValueError`` / ``OSError`` message: a process
    never starts on flags it cannot honour."""
    try:
        return build()
    except (OSError, ValueError) as error:
        parser.error(str(error))
        raise  # parser.error exits; this keeps type checkers sure of the return
