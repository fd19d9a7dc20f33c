"""``splitserve probe`` (``launch/probe.py``), the exec probe of the deployment's internal
ports, against a real internal-plane server (``proto/server.py:start_server`` with the cluster
credential): exit 0 only with the credential and SERVING; ``--alive`` also on NOT_SERVING."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

from splitserve.launch import probe
from splitserve.proto.cluster_auth import TOKEN_ENV, ClusterCredential
from splitserve.proto.server import RoleServer, start_server
from splitserve.proto.tls import TlsConfig, TlsFiles
from tests.certs import make_certificates

CREDENTIAL = ClusterCredential("probe-test-token-0123456789")


@asynccontextmanager
async def _internal_server(
    *, serving: bool, tls: TlsConfig | None = None
) -> AsyncIterator[RoleServer]:
    """An internal-plane server on a free port: health only, the credential required."""
    server = await start_server("127.0.0.1", 0, lambda _server: [], credential=CREDENTIAL, tls=tls)
    await server.set_serving(serving)
    try:
        yield server
    finally:
        await server.server.stop(None)


def _probe_exit_codes(
    probes: Sequence[Sequence[str]],
    *,
    serving: bool,
    tls: TlsConfig | None = None,
    env: dict[str, str] | None = None,
) -> list[int]:
    """Exit statuses of ``probe.main`` with each argument list (``{port}`` filled in), run in a
    thread beside the server's event loop (the probe blocks)."""

    async def body() -> list[int]:
        async with _internal_server(serving=serving, tls=tls) as server:
            codes = []
            for argv in probes:
                filled = [arg.format(port=server.port) for arg in argv]
                codes.append(await asyncio.to_thread(probe.main, filled, env or {}))
            return codes

    return asyncio.run(body())


def test_exit_0_only_with_the_credential_and_serving() -> None:
    address = ["--address", "127.0.0.1:{port}"]
    with_token = [*address, "--cluster-token", CREDENTIAL.token]
    wrong_token = [*address, "--cluster-token", "another-token-0123456789"]
    assert _probe_exit_codes([with_token, address, wrong_token], serving=True) == [0, 1, 1]
    assert _probe_exit_codes([with_token], serving=False) == [1]


def test_alive_passes_on_not_serving_but_not_without_the_credential() -> None:
    alive = ["--address", "127.0.0.1:{port}", "--alive"]
    codes = _probe_exit_codes([[*alive, "--cluster-token", CREDENTIAL.token], alive], serving=False)
    assert codes == [0, 1]


def test_nothing_listening_is_exit_1() -> None:
    assert probe.main(["--address", "127.0.0.1:1", "--timeout", "1", "--alive"], {}) == 1


def test_the_credential_comes_from_the_environment_as_in_the_roles() -> None:
    env = {TOKEN_ENV: CREDENTIAL.token}
    assert _probe_exit_codes([["--address", "127.0.0.1:{port}"]], serving=True, env=env) == [0]


def test_tls_flags_reach_a_mutual_tls_server(tmp_path: Path) -> None:
    certs = make_certificates(tmp_path)
    tls = TlsConfig.load(TlsFiles(certs.cert, certs.key, certs.ca))
    token = ["--address", "127.0.0.1:{port}", "--cluster-token", CREDENTIAL.token]
    named = [*token, *certs.flags(), "--tls-server-name", "localhost"]
    codes = _probe_exit_codes([[*token, *certs.flags()], named, token], serving=True, tls=tls)
    assert codes == [0, 0, 1]


def test_the_exec_command_of_the_manifests_runs_without_torch() -> None:
    """``python -m splitserve.launch.probe`` as the pods run it: exit 1 (nothing listening),
    and torch never loaded (a probe every few seconds must stay cheap)."""
    check = (
        "import runpy, sys\n"
        "sys.argv = ['probe', '--address', '127.0.0.1:1', '--timeout', '1']\n"
        "try:\n"
        "    runpy.run_module('splitserve.launch.probe', run_name='__main__')\n"
        "except SystemExit as exit:\n"
        "    print(exit.code, 'torch' in sys.modules)\n"
    )
    env = {**os.environ, TOKEN_ENV: CREDENTIAL.token}
    result = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, env=env, check=True
    )
    assert result.stdout.splitlines()[-1] == "1 False"


def test_splitserve_probe_runs_it() -> None:
    """``splitserve probe`` (the command table) is the same command."""
    from splitserve.launch import cli

    assert cli.ROLE_COMMANDS["probe"] == probe.__name__
    assert cli.main(["probe", "--address", "127.0.0.1:1", "--timeout", "1"]) == 1
