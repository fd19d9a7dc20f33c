"""The gateway's listening sockets when several gateway processes share one port.

With ``--reuse-port`` every gateway process binds the public port with ``SO_REUSEPORT``, so
the kernel spreads arriving connections over them (by a hash of the connection's addresses:
each connection stays with the process that accepted it, and a process that exits takes
only its own). Linux lets only sockets of the same user share a port this way. Each such
process also listens on a port of its own (``instance``): the address at which its own
``/metrics`` and ``/health`` answer, where the shared port reaches whichever process the
kernel picks.

Without ``--reuse-port`` uvicorn binds the one port itself and a second gateway on it fails
to start (the default: two clusters never share a port by accident).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class Listeners:
    """Bound, listening sockets: ``shared`` on the public port, ``instance`` on this
    process's own."""

    shared: socket.socket
    instance: socket.socket

    @property
    def sockets(self) -> list[socket.socket]:
        return [self.shared, self.instance]

    @property
    def instance_port(self) -> int:
        return self.instance.getsockname()[1]


def _listening(host: str, port: int, backlog: int, reuse_port: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def shared_port_listeners(host: str, port: int, backlog: int) -> Listeners:
    """The public ``port`` bound with ``SO_REUSEPORT`` (0: a free one, which the next
    gateway process is then given) and a free port of this process's own; ``OSError``
    when the public port is held by a socket that does not share it."""
    shared = _listening(host, port, backlog, reuse_port=True)
    try:
        instance = _listening(host, 0, backlog, reuse_port=False)
    except OSError:
        shared.close()
        raise
    return Listeners(shared, instance)
