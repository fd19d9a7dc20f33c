"""The gateway warns at start when the kernel caps its listen backlog below what a crowd
needs (``gateway/main.py:warn_if_backlog_capped``)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from splitserve.gateway.main import LISTEN_BACKLOG, warn_if_backlog_capped


def test_a_capped_backlog_is_named_with_the_setting_to_raise(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    somaxconn = tmp_path / "somaxconn"
    somaxconn.write_text("4096\n")
    with caplog.at_level(logging.WARNING):
        assert warn_if_backlog_capped(somaxconn) == 4096
    assert "net.core.somaxconn is 4096" in caplog.text
    caplog.clear()
    somaxconn.write_text(f"{LISTEN_BACKLOG}\n")
    with caplog.at_level(logging.WARNING):
        assert warn_if_backlog_capped(somaxconn) == LISTEN_BACKLOG
    assert not caplog.text
    assert warn_if_backlog_capped(tmp_path / "missing") is None
