"""etcd closed to strangers: user/password auth and mutual TLS (``proto/etcd_auth.py``,
``proto/etcd_client.py``, ``discovery/etcd_access.py``), against a real etcd.

- A client logged in as a user whose role covers the cluster's prefix puts, reads, leases and
  watches, logging in once for all its calls and streams.
- Without a login, with a wrong password, or on keys outside the user's role, every call and
  the watch fail with ``EtcdAuthError`` (a ``MembershipStoreError``) saying what is wrong.
- A token etcd forgot (it restarted) is renewed without the caller noticing: the next call
  succeeds and the watch goes on after one more login.
- A login given to an etcd with auth off calls without a token, and logs in once auth is
  turned on (the order an operator closes a running cluster in).
- Membership (announcer and watcher) over the auth-enabled etcd, built from the roles'
  settings, the password from the environment and from a file.
- The settings: the password never on a command line (``splitserve up``'s children get
  ``--etcd-user`` and read the password from the environment they inherit); what is refused.
- Mutual TLS: etcd with ``--client-cert-auth`` answers a client presenting the certificate
  and refuses one that does not.
- (slow) ``splitserve up`` with simulated workers on an auth-enabled etcd: the coordinator
  learns its worker from etcd.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from splitserve.common.errors import MembershipStoreError
from splitserve.discovery import Joined, Left
from splitserve.discovery.etcd_access import EtcdAccess, etcd_access
from splitserve.discovery.etcd_announcer import EtcdAnnouncer
from splitserve.discovery.etcd_keys import workers_prefix
from splitserve.discovery.etcd_watcher import EtcdMembershipWatcher
from splitserve.discovery.flags import (
    PASSWORD_ENV,
    MembershipSettings,
    add_membership_args,
    membership_settings,
)
from splitserve.launch.commands import membership_flags
from splitserve.proto.etcd_auth import EtcdLogin
from splitserve.proto.etcd_client import (
    DeleteEvent,
    EtcdAuthError,
    EtcdClient,
    EtcdUnavailable,
    PutEvent,
)
from tests.certs import make_certificates
from tests.cluster import cluster, worker_loads
from tests.etcd import EtcdServer, running_etcd
from tests.test_discovery_etcd import worker

T = TypeVar("T")
CLUSTER = "auth"
PREFIX = f"/splitserve/{CLUSTER}/"
USER = "member"
PASSWORD = "member-secret"
LOGIN = EtcdLogin(USER, PASSWORD)
LOGGED_IN = f"logged in to etcd as {USER}"


def run(scenario: Coroutine[Any, Any, T], timeout_s: float = 20.0) -> T:
    return asyncio.run(asyncio.wait_for(scenario, timeout_s))


@pytest.fixture(scope="module")
def auth_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd for the module, auth on: ``root`` and ``USER`` (readwrite on ``PREFIX``)."""
    with running_etcd(tmp_path_factory.mktemp("auth-etcd")) as server:
        server.add_user(USER, PASSWORD, PREFIX)
        server.enable_auth("root-secret")
        yield server


def _logins(caplog: pytest.LogCaptureFixture) -> int:
    return sum(record.getMessage() == LOGGED_IN for record in caplog.records)


@pytest.mark.timeout(30)
def test_a_logged_in_client_puts_reads_leases_and_watches(
    auth_etcd: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "splitserve.proto.etcd_client")

    async def scenario() -> None:
        async with EtcdClient([auth_etcd.endpoint], login=LOGIN) as client:
            revision = await client.put(f"{PREFIX}a".encode(), b"1")
            got = await client.get(f"{PREFIX}a".encode())
            assert got is not None and got.value == b"1"
            events = client.watch_prefix(PREFIX.encode(), revision + 1)
            # A short lease: the keeper refreshes every ttl/3 and learns of the revoke at
            # its next refresh, which falls inside the wait below even when its first
            # refresh raced ahead of the revoke.
            lease = await client.grant_lease(3)
            await client.put(f"{PREFIX}leased".encode(), b"2", lease)
            keeper = asyncio.create_task(client.keep_alive(lease))
            await client.revoke(lease)
            await asyncio.wait_for(keeper, 5.0)  # etcd reports the lease gone
            put, gone = [await asyncio.wait_for(anext(events), 5.0) for _ in range(2)]
            assert put == PutEvent(f"{PREFIX}leased".encode(), b"2", put.revision)
            assert isinstance(gone, DeleteEvent) and gone.key == put.key
            items, _ = await client.get_prefix(PREFIX.encode())
            assert [kv.key for kv in items] == [f"{PREFIX}a".encode()]
            assert await client.delete(f"{PREFIX}a".encode())
            await events.aclose()

    run(scenario())
    assert _logins(caplog) == 1  # one token for every call and stream


@pytest.mark.timeout(30)
def test_no_login_a_wrong_password_or_foreign_keys_fail_naming_auth(
    auth_etcd: EtcdServer,
) -> None:
    key = f"{PREFIX}x".encode()

    async def scenario() -> None:
        async with EtcdClient([auth_etcd.endpoint]) as anonymous:
            with pytest.raises(EtcdAuthError, match="etcd requires a user.*--etcd-user"):
                await anonymous.put(key, b"1")
            with pytest.raises(EtcdAuthError, match="etcd requires a user"):
                await anonymous.get_prefix(PREFIX.encode())
            with pytest.raises(EtcdAuthError, match="etcd requires a user.*watch cancelled"):
                await anext(anonymous.watch_prefix(PREFIX.encode(), 1))
        wrong = EtcdLogin(USER, "not-the-password")
        async with EtcdClient([auth_etcd.endpoint], login=wrong) as impostor:
            with pytest.raises(EtcdAuthError, match=f"login as '{USER}' refused") as refused:
                await impostor.get(key)
            assert isinstance(refused.value, MembershipStoreError)
            with pytest.raises(EtcdAuthError, match="refused"):
                await anext(impostor.watch_prefix(PREFIX.encode(), 1))
        async with EtcdClient([auth_etcd.endpoint], login=LOGIN) as member:
            with pytest.raises(EtcdAuthError, match=f"user '{USER}' may not touch these keys"):
                await member.put(b"/splitserve/other/x", b"1")
            with pytest.raises(EtcdAuthError, match="may not touch these keys.*watch"):
                await anext(member.watch_prefix(b"/splitserve/other/", 1))

    run(scenario())


@pytest.mark.timeout(60)
def test_a_token_etcd_forgot_is_renewed_without_the_caller_noticing(
    auth_etcd: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "splitserve.proto.etcd_client")
    prefix = f"{PREFIX}renew/".encode()

    async def scenario() -> None:
        # Two clients, so each path renews on its own: one only writes, one only watches.
        async with (
            EtcdClient([auth_etcd.endpoint], login=LOGIN) as writing,
            EtcdClient([auth_etcd.endpoint], login=LOGIN) as watching,
        ):
            revision = await writing.put(prefix + b"before", b"1")
            events = watching.watch_prefix(prefix, revision)
            assert (await asyncio.wait_for(anext(events), 5.0)).key == prefix + b"before"
            auth_etcd.stop()  # a restarted etcd knows none of the tokens it handed out
            auth_etcd.start()
            await writing.put(prefix + b"after", b"2")  # refused once, logged in, retried
            event = await asyncio.wait_for(anext(events), 10.0)  # refused, logged in, reopened
            assert isinstance(event, PutEvent) and event.key == prefix + b"after"
            await events.aclose()

    run(scenario(), 45.0)
    assert _logins(caplog) == 4  # each client once at first and once after the restart


@pytest.mark.timeout(30)
def test_a_login_works_before_auth_is_on_and_after(
    etcd: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "splitserve.proto.etcd_client")

    async def scenario() -> None:
        async with EtcdClient([etcd.endpoint], login=LOGIN) as client:
            await client.put(f"{PREFIX}open".encode(), b"1")  # auth off: no token
            etcd.add_user(USER, PASSWORD, PREFIX)
            etcd.enable_auth("root-secret")
            await client.put(f"{PREFIX}closed".encode(), b"2")  # "user name is empty": log in
            items, _ = await client.get_prefix(PREFIX.encode())
            assert [kv.value for kv in items] == [b"2", b"1"]

    run(scenario())
    assert "etcd has auth off" in caplog.text
    assert _logins(caplog) == 1


def _membership_access(endpoint: str, **settings: Any) -> EtcdAccess:
    membership = MembershipSettings(endpoint, CLUSTER, USER, **settings)
    access = etcd_access(membership, env={PASSWORD_ENV: PASSWORD})
    assert access is not None
    return access


@pytest.mark.timeout(30)
def test_membership_over_an_auth_etcd_from_the_roles_settings(
    auth_etcd: EtcdServer, tmp_path: Path
) -> None:
    password_file = tmp_path / "etcd-password"
    password_file.write_text(f"{PASSWORD}\n")
    info = worker("decode-auth")

    async def scenario() -> None:
        worker_access = _membership_access(auth_etcd.endpoint, etcd_password_file=password_file)
        watcher = EtcdMembershipWatcher(_membership_access(auth_etcd.endpoint).client(), CLUSTER)
        announcer = EtcdAnnouncer(worker_access.client(), CLUSTER)
        await watcher.start()
        changes = watcher.changes()
        await announcer.announce(info)
        assert await asyncio.wait_for(anext(changes), 5.0) == Joined(info)
        await announcer.withdraw()
        assert await asyncio.wait_for(anext(changes), 5.0) == Left("decode-auth")
        await watcher.close()

    run(scenario())


def _parsed(argv: list[str], env: dict[str, str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_membership_args(parser, env)
    return parser.parse_args(argv)


def test_the_password_reaches_children_through_the_environment_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # up's own directory: a relative file is resolved there
    env = {PASSWORD_ENV: PASSWORD}
    up_args = _parsed(["--etcd-endpoints=10.0.0.1:2379, 10.0.0.2:2379", f"--etcd-user={USER}"], env)
    argv = membership_flags(up_args)
    assert argv == [
        "--etcd-endpoints=10.0.0.1:2379,10.0.0.2:2379",
        f"--cluster-name={MembershipSettings().cluster_name}",
        f"--etcd-user={USER}",
    ]
    child = etcd_access(membership_settings(_parsed(argv, env)), env)  # its inherited env
    assert child is not None and child.login == LOGIN
    assert PASSWORD not in repr(child) and PASSWORD not in repr(child.login)
    with pytest.raises(ValueError, match=f"needs its password.*{PASSWORD_ENV}"):
        etcd_access(membership_settings(_parsed(argv, {})), {})

    (tmp_path / "pw").write_text("from-the-file\nignored\n")
    file_argv = [*argv, "--etcd-password-file=pw"]
    flags = membership_flags(_parsed(file_argv, {}))
    assert f"--etcd-password-file={tmp_path.resolve() / 'pw'}" in flags  # for any directory
    from_file = etcd_access(membership_settings(_parsed(file_argv, {})), env)
    assert from_file is not None and from_file.login == EtcdLogin(USER, "from-the-file")


def test_settings_that_cannot_work_are_refused(tmp_path: Path) -> None:
    assert etcd_access(MembershipSettings(etcd_user=USER), {}) is None  # no etcd at all
    with pytest.raises(ValueError, match="--etcd-cert and --etcd-key go together"):
        MembershipSettings("e:1", etcd_cert=tmp_path / "cert.pem")
    with pytest.raises(ValueError, match="--etcd-password-file needs --etcd-user"):
        MembershipSettings("e:1", etcd_password_file=tmp_path / "pw")
    with pytest.raises(ValueError, match="--etcd-password-file: .*No such file"):
        etcd_access(MembershipSettings("e:1", etcd_user=USER, etcd_password_file=tmp_path / "pw"))
    (tmp_path / "pw").write_text("\n")
    with pytest.raises(ValueError, match="pw: no password"):
        etcd_access(MembershipSettings("e:1", etcd_user=USER, etcd_password_file=tmp_path / "pw"))
    (tmp_path / "ca.pem").write_text("not a certificate")
    with pytest.raises(ValueError, match="etcd TLS: .*ca.pem is not a PEM file"):
        etcd_access(MembershipSettings("e:1", etcd_ca=tmp_path / "ca.pem"))


@pytest.mark.timeout(30)
def test_mutual_tls_to_etcd_needs_the_client_certificate(tmp_path: Path) -> None:
    certs = make_certificates(tmp_path / "certs")
    with running_etcd(tmp_path, tls=certs) as server:
        access = etcd_access(
            MembershipSettings(
                server.endpoint, etcd_ca=certs.ca, etcd_cert=certs.cert, etcd_key=certs.key
            )
        )
        assert access is not None and access.credentials is not None

        async def scenario() -> None:
            async with access.client() as client:
                await client.put(b"/tls/k", b"v")
                got = await client.get(b"/tls/k")
                assert got is not None and got.value == b"v"
            no_cert = grpc.ssl_channel_credentials(certs.ca.read_bytes())
            async with EtcdClient([server.endpoint], credentials=no_cert, timeout_s=0.3) as bare:
                with pytest.raises(EtcdUnavailable):  # the handshake is refused
                    await bare.get(b"/tls/k")

        run(scenario())


@pytest.mark.slow  # splitserve up: a coordinator and a simulated worker, as processes
@pytest.mark.timeout(300)
def test_up_with_simulated_workers_on_an_auth_etcd(tmp_path: Path) -> None:
    with running_etcd(tmp_path) as server:
        server.add_user(USER, PASSWORD, "/splitserve/splitserve/")
        server.enable_auth("root-secret")
        up_flags = (f"--etcd-endpoints={server.endpoint}", f"--etcd-user={USER}")
        env = {PASSWORD_ENV: PASSWORD}
        with cluster(0, 1, "--engine=sim", up_flags=up_flags, env=env) as coordinator:
            assert list(worker_loads(coordinator)) == ["decode-0"]  # learnt from etcd

        async def keys_left() -> int:
            async with EtcdClient([server.endpoint], login=LOGIN) as client:
                items, _ = await client.get_prefix(workers_prefix("splitserve"))
                return len(items)

        assert run(keys_left()) == 0  # the drained worker revoked its lease
