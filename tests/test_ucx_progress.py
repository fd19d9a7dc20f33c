"""``UcxSettings.progress_mode`` (``--ucx-progress``): the mode reaches ucxx, a transport in
the spinning mode moves a message byte for byte, and a mode ucxx does not run off the event
loop is refused before UCX starts."""

from __future__ import annotations

import argparse
import asyncio

import pytest
import torch

from splitserve.transfer.ucx_settings import PROGRESS_MODES, UcxSettings
from splitserve.worker.process import add_worker_args, ucx_settings_of


def test_a_mode_ucxx_runs_on_the_loop_or_does_not_know_is_refused() -> None:
    for mode in ("polling", "blocking", "spin"):
        with pytest.raises(ValueError, match="progress mode"):
            UcxSettings(progress_mode=mode)
    assert UcxSettings().progress_mode is None  # ucxx's default, or UCXPY_PROGRESS_MODE


def test_the_worker_flag_sets_the_mode() -> None:
    parser = argparse.ArgumentParser()
    add_worker_args(parser, env={})
    args = parser.parse_args(["--ucx-progress", "thread-polling"])
    assert ucx_settings_of(args).progress_mode == "thread-polling"
    assert ucx_settings_of(parser.parse_args([])).progress_mode is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--ucx-progress", "polling"])


@pytest.mark.parametrize("mode", PROGRESS_MODES)
def test_a_transport_in_each_mode_moves_a_message(mode: str) -> None:
    ucxx = pytest.importorskip("ucxx", reason="UCX (ucxx) is not installed here")
    from splitserve.transfer.ucx import UcxTransport

    async def body() -> None:
        transport = UcxTransport(UcxSettings(progress_mode=mode))
        try:
            assert ucxx.core._get_ctx().progress_mode == mode  # ucxx's context took it
            endpoint = await transport.connect(transport.address)  # to itself
            sent = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
            received = torch.zeros_like(sent)
            receive = asyncio.ensure_future(transport.recv(0x5EED, received))
            await endpoint.send(0x5EED, sent)
            await asyncio.wait_for(receive, 10)
            assert torch.equal(received, sent)
        finally:
            await transport.close()

    try:
        asyncio.run(body())
    finally:
        ucxx.reset()  # one ucxx context per process: the next UCX test makes its own
