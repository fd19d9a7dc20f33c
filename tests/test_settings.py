"""Flags declared once as typed settings (``common/settings.py``): the parser made from a
settings class, the environment twins, the usage errors, and the command line made back from
a settings object (what ``splitserve up`` starts each role with)."""

from __future__ import annotations

import argparse
import dataclasses
import enum
from dataclasses import dataclass
from pathlib import Path

import pytest

from splitserve.common.settings import (
    add_settings_args,
    default_group,
    setting,
    settings_argv,
    settings_of,
    settings_or_exit,
)
from splitserve.coordinator.placement import PlacementMode
from splitserve.coordinator.settings import CoordinatorSettings


class Color(enum.StrEnum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Inner:
    cluster: str = setting("main", "the cluster")
    endpoints: str | None = setting(None, "where it lives")


@dataclass(frozen=True)
class Example:
    port: int = setting(8000, "the port")
    ratio: float = setting(0.5, "a share")
    color: Color = setting(Color.RED, "a color")
    file: Path | None = setting(None, "a file")
    fast: bool = setting(False, "go fast")
    safe: bool = setting(True, "stay safe")
    key: tuple[str, ...] = setting((), "a key", env=False)
    mode: str = setting("a", "a mode", choices=("a", "b"))
    inner: Inner = default_group(Inner)
    not_a_flag: int = 7

    def __post_init__(self) -> None:
        if not 0 <= self.ratio <= 1:
            raise ValueError(f"--ratio must be in [0, 1], not {self.ratio}")


def _parser(env: dict[str, str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="example")
    add_settings_args(parser, Example, env or {})
    return parser


def _parse(argv: list[str], env: dict[str, str] | None = None) -> Example:
    return settings_of(_parser(env).parse_args(argv), Example)


def test_defaults_flags_and_groups_become_the_settings_object() -> None:
    assert _parse([]) == Example()
    parsed = _parse(
        ["--port=9", "--color", "blue", "--file=/tmp/x", "--fast", "--no-safe", "--key=a"]
        + ["--key=b", "--mode=b", "--cluster=other", "--endpoints=h:1"]
    )
    assert parsed == Example(
        port=9,
        color=Color.BLUE,
        file=Path("/tmp/x"),
        fast=True,
        safe=False,
        key=("a", "b"),
        mode="b",
        inner=Inner(cluster="other", endpoints="h:1"),
    )
    assert isinstance(parsed.port, int) and isinstance(parsed.color, Color)


def test_the_environment_twin_sits_between_the_default_and_the_command_line() -> None:
    env = {"SPLITSERVE_PORT": "7", "SPLITSERVE_FAST": "1", "SPLITSERVE_CLUSTER": "envs"}
    assert _parse([], env) == Example(port=7, fast=True, inner=Inner(cluster="envs"))
    assert _parse(["--port=8", "--cluster=cli"], env).port == 8
    assert _parse(["--cluster=cli"], env).inner.cluster == "cli"
    assert "(env SPLITSERVE_PORT)" in _parser().format_help()
    assert "SPLITSERVE_KEY" not in _parser().format_help()  # env=False


def test_bad_values_are_usage_errors_naming_the_flag_and_the_twin(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cases = [
        (["--color=green"], {}, "--color: must be one of red, blue, not 'green'"),
        (["--port=x"], {}, "--port: must be a int, not 'x'"),
        ([], {"SPLITSERVE_PORT": "x"}, "not 'x' (from SPLITSERVE_PORT)"),
        (["--mode=c"], {}, "--mode: invalid choice: 'c'"),
        (["--ratio=2"], {}, "--ratio must be in [0, 1], not 2.0"),
    ]
    for argv, env, message in cases:
        parser = _parser(env)
        with pytest.raises(SystemExit) as exited:
            settings_or_exit(parser, parser.parse_args(argv), Example)
        assert exited.value.code == 2
        assert message in capsys.readouterr().err


def test_the_command_line_of_a_settings_object_gives_it_back() -> None:
    changed = Example(
        port=1,
        color=Color.BLUE,
        file=Path("f"),
        fast=True,
        safe=False,
        key=("x", "y"),
        inner=Inner(endpoints="e:1"),
    )
    argv = settings_argv(changed)
    assert argv == [
        "--port=1",
        "--color=blue",
        "--file=f",
        "--fast",
        "--no-safe",
        "--key=x",
        "--key=y",
        "--endpoints=e:1",
    ]
    assert _parse(argv) == changed
    assert settings_argv(Example()) == []


def test_the_coordinators_flags_round_trip_through_its_settings() -> None:
    """Every coordinator flag is a setting: each one changed survives argv and back."""
    from splitserve.coordinator.main import build_parser

    assert "--late-waiters-yield" in build_parser().format_help()
    parser = argparse.ArgumentParser()
    add_settings_args(parser, CoordinatorSettings, {})
    defaults = settings_of(parser.parse_args([]), CoordinatorSettings)
    assert defaults == CoordinatorSettings()
    changed = dataclasses.replace(
        defaults,
        port=1234,
        placement=PlacementMode.ADAPTIVE,
        kv_share=0.25,
        late_waiters_yield=False,
        admit_within_tpot=True,
        tenants_file=Path("t.toml"),
        relay="per-stream",
    )
    assert settings_of(parser.parse_args(settings_argv(changed)), CoordinatorSettings) == changed
    assert changed.admission_config().kv_share == 0.25
    assert changed.routing_config().mode is PlacementMode.ADAPTIVE
