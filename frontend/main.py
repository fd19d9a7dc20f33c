"""``splitserve frontend``: a coordinator and the OpenAI-compatible gateway in one process.

The coordinator serves as ``splitserve coordinator`` does (both gRPC planes, the same flags
and ready lines); once its public plane serves, the gateway starts on ``--http-port`` in
front of it and prints ``splitserve gateway ready at http(s)://<host>:<port>``. The gateway's
streams reach the coordinator without gRPC (``proto/local_streams.py``: its
``GenerateStreams`` method runs as a task of this process, its batches handed over
unserialized); its other calls (model info, tokenize) dial the coordinator's public port.
Other clients (gRPC, other gateways) reach the coordinator as always. Why: one process to
deploy and drain instead of two, and no serialization, framing and parsing of every relayed
batch between them (``bench/bench_relay_cpu.py``: 29.4 us of CPU a streamed token in one
process against 30.0 in two at 1,024 simulated streams; the hop costs little a token when
hundreds of streams share each message).

One event loop (uvloop) runs both. SIGINT / SIGTERM drain both at once: the HTTP server
stops accepting and gives open streams ``--drain-timeout`` seconds (uvicorn's graceful
shutdown), the coordinator goes NOT_SERVING, refuses new calls and drains its gRPC callers;
the workers' channels close only after the HTTP drain ended (its streams use them). Then
it exits 0. A coordinator bound to every address (0.0.0.0, ::) is dialled at 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence

import uvicorn
import uvloop

from splitserve.common.orphan import stop_when_orphaned
from splitserve.common.settings import add_settings_args, settings_or_exit
from splitserve.common.tracing import shutdown_tracing
from splitserve.coordinator.main import PreparedCoordinator, prepare, serve
from splitserve.coordinator.servicer import CoordinatorServicer
from splitserve.frontend.settings import FrontendSettings, gateway_settings
from splitserve.gateway.app import create_app
from splitserve.gateway.main import (
    config_of,
    http_server,
    serve_http,
    serves_tls,
    warn_if_backlog_capped,
)
from splitserve.proto.local_streams import local_opener

WATCH_S = 0.1
"""How often the stop watcher looks for a signal (uvicorn's handler only sets a flag)."""
ANY_ADDRESS = {"0.0.0.0", "::", "[::]", ""}

_signalled = False
"""A stop signal came while uvicorn's own handlers were not installed."""


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``FrontendSettings`` (``settings.py``)."""
    parser = argparse.ArgumentParser(prog="splitserve frontend", description=__doc__)
    add_settings_args(parser, FrontendSettings)
    return parser


def dial_address(address: str) -> str:
    """Where this process dials a server of its own bound to ``address`` ("host:port")."""
    host, _, port = address.rpartition(":")
    return f"127.0.0.1:{port}" if host in ANY_ADDRESS else address


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    settings = settings_or_exit(parser, args, FrontendSettings)
    prepared = prepare(parser, args, role="frontend")
    warn_if_backlog_capped()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _note_signal)  # uvicorn's own handlers replace these while it serves
    stop_when_orphaned()  # up died: SIGTERM ourselves, which drains
    try:
        uvloop.run(_serve(parser, settings, prepared))
    finally:
        shutdown_tracing()
    return 0


def _note_signal(signum: int, frame: object) -> None:
    """A stop signal outside uvicorn's serving (before it, or re-raised after its drain)."""
    global _signalled
    _signalled = True


async def _serve(
    parser: argparse.ArgumentParser, settings: FrontendSettings, prepared: PreparedCoordinator
) -> None:
    """Serve the coordinator, then the gateway in front of it, until a stop signal; drain
    both (the module's order)."""
    stop = asyncio.Event()
    http_drained = asyncio.Event()
    ready: asyncio.Future[tuple[CoordinatorServicer, str]] = (
        asyncio.get_running_loop().create_future()
    )

    def serving(servicer: CoordinatorServicer, address: str) -> None:
        ready.set_result((servicer, address))

    coordinator = asyncio.create_task(serve(prepared, stop, serving, http_drained.wait))
    await asyncio.wait([ready, coordinator], return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():  # the coordinator failed to start
        await coordinator
        return
    servicer, address = ready.result()
    gateway = gateway_settings(settings, dial_address(address))
    tls = prepared.access.tls
    config = config_of(parser, gateway, prepared.keys, tls, local_opener(servicer.GenerateStreams))
    app = create_app(config)
    server = http_server(gateway, app, tls)
    watcher = asyncio.create_task(_stop_on_signal(server, stop))
    try:
        await serve_http(server, app, gateway, None, serves_tls(tls))
    finally:
        http_drained.set()
        stop.set()
        watcher.cancel()
        await coordinator


async def _stop_on_signal(server: uvicorn.Server, stop: asyncio.Event) -> None:
    """Set ``stop`` (the coordinator's drain) as soon as uvicorn was told to stop, or a stop
    signal came before its handlers were installed (then uvicorn is told too)."""
    while not (server.should_exit or _signalled):
        await asyncio.sleep(WATCH_S)
    server.should_exit = True
    stop.set()


if __name__ == "__main__":
    sys.exit(main())
