"""A served worker's engine flags: speculative decoding's default and its environment twin."""

from __future__ import annotations

import argparse

from splitserve.engine.cli_args import (
    SERVED_SPECULATIVE_TOKENS,
    add_engine_args,
    engine_config_from_args,
)
from splitserve.engine.config import EngineConfig


def _config(argv: list[str], env: dict[str, str] | None = None) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser, env or {})
    return engine_config_from_args(parser.parse_args(argv))


def test_a_served_cpu_worker_drafts_by_default_and_either_way_can_turn_it_off() -> None:
    assert SERVED_SPECULATIVE_TOKENS > 0
    assert _config([]).speculative.num_tokens == SERVED_SPECULATIVE_TOKENS
    assert _config(["--speculative-tokens=0"]).speculative.num_tokens == 0
    assert _config([], {"SPLITSERVE_SPECULATIVE_TOKENS": "0"}).speculative.num_tokens == 0
    assert _config([], {"SPLITSERVE_SPECULATIVE_TOKENS": "2"}).speculative.num_tokens == 2


def test_a_cuda_worker_drafts_only_when_asked() -> None:
    assert _config(["--device=cuda"]).speculative.num_tokens == 0
    assert _config(["--device=cuda", "--speculative-tokens=3"]).speculative.num_tokens == 3
