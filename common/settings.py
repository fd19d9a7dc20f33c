"""A role's flags declared once, as a typed settings dataclass; its parser and its command line
are generated from it.

A settings class is a frozen dataclass whose fields are made by ``setting(default, help)``:
the field ``max_queued`` is the flag ``--max-queued`` (another name: ``flag=``) with the
environment twin ``SPLITSERVE_MAX_QUEUED`` (``env_flags.py``: the command line wins over the
environment, which wins over the default). A field whose type is another settings class is a
group: its flags join the parser's at the same level (``--etcd-endpoints`` of a role's
``membership`` group). A class whose ``ENV`` is False has no environment twins. A class
checks its own values in ``__post_init__`` (``ValueError``),
which ``settings_or_exit`` turns into the parser's usage error (exit status 2).

- ``add_settings_args(parser, cls)``: the parser's flags, from the fields;
- ``settings_or_exit(parser, args, cls)``: the parsed values as a ``cls``;
- ``settings_argv(settings)``: the flags that make a process with those settings: every value
  that differs from its field's default, in declaration order (``launch/up.py`` starts each
  role from its settings object this way).

Types a flag may have: ``str``, ``int``, ``float``, ``bool`` (off by default: ``--x``; on by
default: ``--x`` / ``--no-x``), ``pathlib.Path``, an ``enum.Enum`` of string values, any of
them ``| None`` (no value), and ``tuple[str, ...]`` (a flag repeated, one item each).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import types
import typing
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from splitserve.common.env_flags import env_name, truthy

S = TypeVar("S")

_META = "splitserve.setting"


@dataclass(frozen=True)
class _FlagSpec:
    help: str
    flag: str | None
    """The flag's name when it is not the field's (``--x-y`` for ``x_y``)."""
    choices: tuple[str, ...] | None
    env: bool
    """Whether the flag has a ``SPLITSERVE_*`` twin."""


def setting(
    default: Any,
    help: str,  # noqa: A002  # the argparse word
    *,
    flag: str | None = None,
    choices: tuple[str, ...] | None = None,
    env: bool = True,
) -> Any:
    """A settings field: its default, its flag's help, and optionally the flag's name, its
    allowed values and whether it has an environment twin."""
    spec = _FlagSpec(help, flag, choices, env)
    return dataclasses.field(default=default, metadata={_META: spec})


@dataclass(frozen=True)
class _Flag:
    """One field of a settings class (or of a group in it) as a flag."""

    path: tuple[str, ...]
    """Field names from the settings class down to this field."""
    name: str
    kind: type
    """The value's type, without ``| None``; ``tuple`` for a repeated flag."""
    optional: bool
    default: Any
    spec: _FlagSpec

    @property
    def dest(self) -> str:
        """Where argparse keeps the value: the flag's own name (``args.max_queued``), so
        code that reads a group's flags from ``args`` reads them the same inside any role."""
        return self.name.removeprefix("--").replace("-", "_")

    def parse(self, raw: str) -> Any:
        """The value ``raw`` (a command-line argument or an environment twin) stands for;
        ``argparse.ArgumentTypeError`` naming the allowed values when it stands for none."""
        if self.kind is bool:
            return truthy(raw)
        if self.kind is tuple:
            return tuple(item.strip() for item in raw.split(",") if item.strip())
        try:
            return self.kind(raw)
        except ValueError:
            if issubclass(self.kind, enum.Enum):
                allowed = ", ".join(str(member.value) for member in self.kind)
                message = f"must be one of {allowed}, not {raw!r}"
            else:
                message = f"must be a {self.kind.__name__}, not {raw!r}"
            raise argparse.ArgumentTypeError(message) from None

    def parser_from(self, env_raw: str | None) -> Callable[[str], Any]:
        """``parse`` as argparse's ``type``; an error on the environment twin's value names
        the twin."""

        def parse(raw: str) -> Any:
            try:
                return self.parse(raw)
            except argparse.ArgumentTypeError as error:
                if env_raw is None or raw != env_raw:
                    raise
                raise argparse.ArgumentTypeError(f"{error} (from {env_name(self.name)})") from None

        return parse

    def render(self, value: Any) -> list[str]:
        """The arguments that set this flag to ``value`` (from its default)."""
        if self.kind is bool:
            return [self.name if value else f"--no-{self.name.removeprefix('--')}"]
        if self.kind is tuple:
            return [f"{self.name}={item}" for item in value]
        if isinstance(value, enum.Enum):
            value = value.value
        return [f"{self.name}={value}"]


def _is_settings(kind: object) -> bool:
    return isinstance(kind, type) and dataclasses.is_dataclass(kind)


def _unwrap(hint: object) -> tuple[type, bool]:
    """(the type, whether ``None`` is allowed) of a field's annotation."""
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        members = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        optional = len(members) < len(typing.get_args(hint))
        hint = members[0]
    if typing.get_origin(hint) is tuple:
        return tuple, optional
    assert isinstance(hint, type), f"unsupported setting type {hint!r}"
    return hint, optional


def _flags(
    cls: type, path: tuple[str, ...] = (), into_groups: bool = True
) -> Iterator[_Flag | tuple[str, type]]:
    """The flags of ``cls`` and of its groups, in declaration order; with ``into_groups``
    False, a group that has a ``TITLE`` comes as (field name, its class) instead."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        if _is_settings(kind):
            if not into_groups and getattr(kind, "TITLE", None):
                yield field.name, kind
            else:
                yield from _flags(kind, (*path, field.name), into_groups)
            continue
        spec = field.metadata.get(_META)
        if spec is None:
            continue  # not a flag: set by the role itself
        kind, optional = _unwrap(kind)
        name = spec.flag or "--" + field.name.replace("_", "-")
        if not getattr(cls, "ENV", True):  # a class whose flags have no twins
            spec = dataclasses.replace(spec, env=False)
        yield _Flag((*path, field.name), name, kind, optional, field.default, spec)


def _all_flags(cls: type) -> Iterator[_Flag]:
    for flag in _flags(cls):
        assert isinstance(flag, _Flag)
        yield flag


def add_settings_args(
    parser: argparse._ActionsContainer, cls: type, env: Mapping[str, str] = os.environ
) -> None:
    """Add a flag for every setting of ``cls`` (and of its groups) to ``parser``, each
    defaulting to its environment twin where that is set. A group whose class has a
    ``TITLE`` gets an argument group of that title (in ``--help``) where ``parser`` is a
    parser."""
    for flag in _flags(cls, into_groups=not isinstance(parser, argparse.ArgumentParser)):
        if isinstance(flag, tuple):
            _, group = flag
            add_settings_args(parser.add_argument_group(group.TITLE), group, env)  # type: ignore[attr-defined]
            continue
        default = flag.default
        help_text = flag.spec.help
        raw = None
        if flag.spec.env:
            twin = env_name(flag.name)
            raw = env.get(twin)
            help_text = f"{help_text} (env {twin})"
        options: dict[str, Any] = {"dest": flag.dest, "default": default, "help": help_text}
        if flag.kind is bool:
            options["action"] = argparse.BooleanOptionalAction if flag.default else "store_true"
            options["default"] = default if raw is None else truthy(raw)
        elif flag.kind is tuple:  # argparse copies the default list before appending
            options["action"] = "append"
            options["default"] = list(default if raw is None else flag.parse(raw))
            options["help"] += "; repeat for more"
        else:  # argparse parses a string default as it would the flag's argument
            options["type"] = flag.parser_from(raw)
            options["default"] = default if raw is None else raw
            if flag.spec.choices is not None:
                options["choices"] = flag.spec.choices
        parser.add_argument(flag.name, **options)


def settings_of(args: argparse.Namespace, cls: Callable[..., S]) -> S:
    """The parsed ``args`` as a ``cls``; raises ``ValueError`` for values the class refuses."""
    return _build(args, cls)


def _build(args: argparse.Namespace, cls: Any) -> Any:
    hints = typing.get_type_hints(cls)
    values = {}
    for field in dataclasses.fields(cls):
        if _is_settings(hints[field.name]):
            values[field.name] = _build(args, hints[field.name])
            continue
        spec = field.metadata.get(_META)
        if spec is None:
            continue
        dest = (spec.flag or "--" + field.name).removeprefix("--").replace("-", "_")
        value = getattr(args, dest)
        if isinstance(value, list):  # a repeated flag
            value = tuple(value)
        values[field.name] = value
    return cls(**values)


def settings_or_exit(
    parser: argparse.ArgumentParser, args: argparse.Namespace, cls: Callable[..., S]
) -> S:
    """``settings_of``, or the parser's usage error (exit status 2) naming what is wrong."""
    try:
        return settings_of(args, cls)
    except ValueError as error:
        parser.error(str(error))
        raise  # parser.error exits; this keeps type checkers sure of the return


def settings_argv(settings: object, always: Collection[str] = ()) -> list[str]:
    """The flags that give a process ``settings``: each value that differs from its field's
    default, and each flag named in ``always`` (a value the child must take even where its
    environment twin says otherwise), in declaration order (groups in place)."""
    argv: list[str] = []
    for flag in _all_flags(type(settings)):
        value: Any = settings
        for name in flag.path:
            value = getattr(value, name)
        if value is not None and (value != flag.default or flag.name in always):
            argv += flag.render(value)
    return argv


def default_group(cls: Callable[[], S]) -> S:
    """A group's default value, for a settings field of that group's type."""
    return dataclasses.field(default_factory=cls)  # type: ignore[return-value]
