"""``splitserve up``'s children's command lines: membership flags go to the coordinators and
workers exactly when ``--etcd-endpoints`` is given, to a gateway only where its stored
responses live in etcd (several gateways with etcd membership)."""

from __future__ import annotations

import argparse

import pytest

from splitserve.launch.dual_worker import roles_of
from splitserve.launch.up import (
    build_parser,
    coordinator_argv,
    gateway_argv,
    layout_summary,
    member_ids,
    shares_response_file,
    worker_argvs,
)
from splitserve.worker.process import add_worker_args
from splitserve.worker.runtime import engine_config_for, role_worker_id


def _children(*flags: str) -> tuple[list[str], list[list[str]], list[str]]:
    args = build_parser().parse_args(["--prefill=1", "--decode=2", *flags])
    workers = [argv for _, argv in worker_argvs(args, "127.0.0.1:50052", [])]
    return coordinator_argv(args), workers, gateway_argv(args, "127.0.0.1:50051")


def test_etcd_membership_reaches_every_coordinator_and_worker() -> None:
    coordinator, workers, gateway = _children(
        "--etcd-endpoints= 10.0.0.1:2379,10.0.0.2:2379 ", "--cluster-name=blue"
    )
    membership = ["--etcd-endpoints=10.0.0.1:2379,10.0.0.2:2379", "--cluster-name=blue"]
    for argv in (coordinator, *workers):
        assert all(flag in argv for flag in membership), argv
    for argv in workers:  # they learn of no coordinator: the coordinators watch etcd
        assert not any(flag.startswith("--coordinator") for flag in argv), argv
    assert not any(flag.startswith("--etcd") for flag in gateway)


def test_several_gateways_share_their_stored_responses() -> None:
    """One gateway keeps them in memory; several answer any connection, so they share a
    SQLite file of up's, or etcd where membership is there; a store asked for is kept."""
    one = build_parser().parse_args([])
    assert not any(flag.startswith("--response-store") for flag in gateway_argv(one, "a:1"))
    several = build_parser().parse_args(["--gateways=2", "--apart"])
    assert shares_response_file(several)
    argv = gateway_argv(several, "a:1", shared_dir="/tmp/up-x")
    assert "--response-store=sqlite:/tmp/up-x/responses.db" in argv, argv
    assert not any(flag.startswith("--etcd") for flag in argv), argv
    on_etcd = build_parser().parse_args(["--gateways=2", "--etcd-endpoints=10.0.0.1:2379"])
    assert not shares_response_file(on_etcd)
    argv = gateway_argv(on_etcd, "a:1")
    assert "--response-store=etcd" in argv and "--etcd-endpoints=10.0.0.1:2379" in argv, argv
    asked = build_parser().parse_args(["--gateways=2", "--response-store=none"])
    assert not shares_response_file(asked)
    assert "--response-store=none" in gateway_argv(asked, "a:1")
    merged = build_parser().parse_args(["--response-store=none", "--response-store-ttl=60"])
    frontend = coordinator_argv(merged)
    assert "--response-store=none" in frontend and "--response-store-ttl=60.0" in frontend


def test_without_etcd_no_membership_flag_is_passed() -> None:
    coordinator, workers, gateway = _children()
    for argv in (coordinator, *workers, gateway):
        assert not any(f.startswith(("--etcd", "--cluster-name")) for f in argv), argv
    assert all("--coordinator=127.0.0.1:50052" in argv for argv in workers)


def test_the_startup_line_says_how_prompts_are_placed() -> None:
    args = build_parser().parse_args(["--placement=adaptive", "--decode=2"])
    summary = layout_summary(args)
    assert "1 prefill + 2 decode workers" in summary and "placed by adaptive" in summary
    assert "--placement=adaptive" in coordinator_argv(args)


def test_dual_role_workers_run_the_worker_command_with_both_roles_a_core_each() -> None:
    args = build_parser().parse_args(["--prefill=0", "--decode=0", "--dual=2"])
    workers = worker_argvs(args, "127.0.0.1:50052", [])
    assert [name for name, _ in workers] == ["dual-0", "dual-1"]
    for _, argv in workers:
        assert argv[:2] == ["splitserve.launch.dual_worker", "--roles=prefill,decode"], argv
    assert "0 prefill + 0 decode worker + 2 dual-role" in layout_summary(args)


def test_the_worker_command_reads_its_roles() -> None:
    assert [role.name for role in roles_of("prefill,decode")] == ["prefill", "decode"]
    assert [role.name for role in roles_of("decode")] == ["decode"]
    for bad in ("", "prefill,prefill", "encode", "decode,router"):
        with pytest.raises(ValueError, match="--roles"):
            roles_of(bad)


def test_up_waits_for_the_member_ids_its_workers_register_under() -> None:
    args = build_parser().parse_args(["--prefill=1", "--decode=1", "--dual=1"])
    argvs = [argv for _, argv in worker_argvs(args, "127.0.0.1:50052", [])]
    registered = []
    for argv in argvs:
        (worker_id,) = [f.split("=", 1)[1] for f in argv if f.startswith("--worker-id=")]
        (roles_flag,) = [f.split("=", 1)[1] for f in argv if f.startswith("--roles=")] or [
            argv[0].split(".")[1]  # splitserve.<role>.main
        ]
        roles = roles_of(roles_flag)
        registered += [role_worker_id(worker_id, role, roles) for role in roles]
    assert member_ids(argvs) == registered
    assert registered == ["prefill-0", "decode-1", "dual-2-prefill", "dual-2-decode"]
    # flags after `--` reach every worker last: a worker id given there is the one it uses
    renamed = [argv for _, argv in worker_argvs(args, "127.0.0.1:50052", ["--worker-id", "x"])]
    assert member_ids(renamed) == ["x", "x", "x-prefill", "x-decode"]


def test_simulated_workers_share_processes_a_role_at_a_time_unpinned() -> None:
    args = build_parser().parse_args(["--prefill=3", "--decode=4", "--workers-per-process=2"])
    workers = worker_argvs(args, "127.0.0.1:50052", ["--engine=sim"])
    assert [name for name, _ in workers] == ["prefill-0", "prefill-1", "decode-2", "decode-3"]
    hosted = [[f for f in argv if f.startswith("--host-workers")] for _, argv in workers]
    assert hosted == [["--host-workers=2"], [], ["--host-workers=2"], ["--host-workers=2"]]
    assert not any(f.startswith("--cpu-affinity") for _, argv in workers for f in argv)
    assert member_ids([argv for _, argv in workers]) == [
        "prefill-0-0", "prefill-0-1", "prefill-1", "decode-2-0", "decode-2-1", "decode-3-0",
        "decode-3-1",
    ]  # fmt: skip
    assert "(up to 2 a process)" in layout_summary(args)
    ports = [[f for f in argv if f.startswith("--metrics-port")] for _, argv in workers]
    assert ports == [[f"--metrics-port={9401 + first}"] for first in (0, 2, 3, 5)]  # +i each


def test_only_a_worker_with_a_decode_role_keeps_the_decode_gemvs_weights() -> None:
    """A prefill-only worker's engine computes prompt rows only: it packs no GEMV copy of its
    projections' weights (``RunnerConfig.decodes``); a decode or dual-role worker does."""
    parser = argparse.ArgumentParser()
    add_worker_args(parser, env={})
    args = parser.parse_args([])
    decodes = {
        roles: engine_config_for(args, roles_of(roles)).runner.decodes
        for roles in ("prefill", "decode", "prefill,decode")
    }
    assert decodes == {"prefill": False, "decode": True, "prefill,decode": True}


def test_several_gateways_share_the_http_port() -> None:
    """``--gateways N``: each gateway gets ``--reuse-port`` (the kernel spreads connections
    over them); one gateway binds its port alone, as before."""
    _, _, alone = _children()
    assert "--reuse-port" not in alone and "--port=8000" in alone
    args = build_parser().parse_args(["--gateways=3", "--http-port=9000"])
    shared = gateway_argv(args, "127.0.0.1:50051", shared_dir="/tmp/up-x")
    assert "--reuse-port" in shared and "--port=9000" in shared
    assert "3 gateways sharing the HTTP port" in layout_summary(args)
