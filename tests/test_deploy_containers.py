"""What the containers of ``deploy/base``'s pods run and get, checked without a cluster against
the code that reads it (the manifests rendered as ``test_deploy_manifests.py`` renders them:
``deploy_support.py``):

- every container's arguments and ``SPLITSERVE_*`` variables parse with its role's real
  parser, and every such variable is a flag twin of that role; pods get no service-link
  variables; the workers carry their role's labels, advertise their pod IP and share one etcd
  membership; etcd's members and the gateway's coordinators are named by their headless
  Services;
- probes name ports the container has, exec probes parse as ``splitserve probe`` and carry
  the credential; liveness and startup never depend on other pods; the grace period outlasts
  preStop + ``--drain-timeout``;
- referenced Secrets and keys exist, the API keys file is the mounted Secret, only the roles
  that need the cluster token get it, and the Secrets' placeholders are refused by the code
  that reads them.

Not covered: anything a cluster does (scheduling, DNS, probes running, the image itself).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from splitserve.common.api_keys import ApiKeys
from splitserve.common.env_flags import env_name
from splitserve.launch import probe
from splitserve.proto.cluster_auth import TOKEN_ENV, ClusterCredential
from tests.deploy_support import (
    ROLE_LABEL,
    VALID_TOKEN,
    WORKER_ROLES,
    WORKLOAD_KINDS,
    Doc,
    _container_env,
    _container_port,
    _containers,
    _named,
    _of_kind,
    _parsed_args,
    _pod_labels,
    _role,
    _role_parser,
    _secret_value,
    _selected_workloads,
)

PROBES = ("startupProbe", "livenessProbe", "readinessProbe")
PROBE_COMMAND = ["python", "-m", "splitserve.launch.probe"]
SHUTDOWN_MARGIN_S = 5
"""Seconds a pod's grace period must leave after preStop + ``--drain-timeout`` (closing the
servers, the engine and the transport)."""


def _env_twins(parser: argparse.ArgumentParser) -> set[str]:
    """The ``SPLITSERVE_*`` names of a parser's ``--flags``."""
    return {
        env_name(option)
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--")
    }


def _prestop_seconds(container: Doc) -> float:
    """Seconds a container's preStop hook waits (``sleep N``); 0 without one."""
    hook = container.get("lifecycle", {}).get("preStop")
    if hook is None:
        return 0.0
    command = hook["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, f"unexpected preStop {command}"
    return float(command[1])


# ---------------------------------------------------------------- tests: the roles


def test_every_container_command_line_parses_with_its_role_parser() -> None:
    roles = []
    for _workload, container in _containers():
        role = _role(container)
        if role is None:
            assert container["name"] == "etcd"
            continue
        roles.append(role)
        args = _parsed_args(container)
        assert args.host == "0.0.0.0", f"{role} must listen on the pod's address"
        assert _container_port(container, "grpc" if role != "gateway" else "http") == args.port
    assert sorted(roles) == ["coordinator", "decode", "gateway", "prefill"]


def test_splitserve_variables_are_flag_twins_of_the_role_that_gets_them() -> None:
    for _workload, container in _containers():
        role = _role(container)
        if role is None:
            continue
        env = _container_env(container)
        twins = _env_twins(_role_parser(role, env))
        unknown = {name for name in env if name.startswith("SPLITSERVE_")} - twins
        assert not unknown, f"{role}: {unknown} are no flag of `splitserve {role}`"


def test_pods_get_no_service_link_variables() -> None:
    """``SPLITSERVE_*`` variables are flag twins; a Service's link variables (e.g.
    SPLITSERVE_COORDINATOR_PORT) must never reach a role."""
    for workload in _of_kind(*WORKLOAD_KINDS):
        assert workload["spec"]["template"]["spec"]["enableServiceLinks"] is False


def test_worker_deployments_carry_role_labels_and_leave_replicas_to_the_autoscaler() -> None:
    for role in WORKER_ROLES:
        deployment = _named("Deployment", f"splitserve-{role}")
        assert deployment["metadata"]["labels"][ROLE_LABEL] == role
        assert _pod_labels(deployment)[ROLE_LABEL] == role
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        assert _role(container) == role
        assert "replicas" not in deployment["spec"]


def test_workers_advertise_their_pod_ip_and_share_one_etcd_membership() -> None:
    etcd_service = _named("Service", "splitserve-etcd")
    etcd_port = next(p["port"] for p in etcd_service["spec"]["ports"] if p["name"] == "client")
    clusters = set()
    for _workload, container in _containers():
        role = _role(container)
        if role in (*WORKER_ROLES, "coordinator"):
            args = _parsed_args(container)
            for endpoint in args.etcd_endpoints.split(","):
                host, port = endpoint.strip().rsplit(":", 1)
                assert host.split(".")[-1] == "splitserve-etcd" and int(port) == etcd_port
            clusters.add(args.cluster_name)
        if role in WORKER_ROLES:
            assert "--advertise-host=$(POD_IP)" in container["args"]
            pod_ip = next(v for v in container["env"] if v["name"] == "POD_IP")
            assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            assert _parsed_args(container).coordinator is None  # membership is etcd's
    assert len(clusters) == 1


def test_etcd_members_are_named_by_their_headless_service() -> None:
    """ETCD_INITIAL_CLUSTER names exactly the StatefulSet's members at their peer URLs (so
    scaling to three means changing both, as deploy/README.md says)."""
    [etcd] = _of_kind("StatefulSet")
    service = _named("Service", etcd["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    assert _selected_workloads(service["spec"]["selector"]) == [etcd]
    [container] = etcd["spec"]["template"]["spec"]["containers"]
    env = {var["name"]: var.get("value") for var in container["env"]}
    peer = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "peer")
    assert _container_port(container, "peer") == peer
    name, governing = etcd["metadata"]["name"], service["metadata"]["name"]
    members = [f"{name}-{i}" for i in range(etcd["spec"]["replicas"])]
    expected = [f"{m}=http://{m}.{governing}:{peer}" for m in members]
    assert env["ETCD_INITIAL_CLUSTER"].split(",") == expected
    assert env["ETCD_INITIAL_ADVERTISE_PEER_URLS"] == f"http://$(ETCD_NAME).{governing}:{peer}"


def test_the_gateway_replicas_share_their_stored_responses_in_the_clusters_etcd() -> None:
    """Several replicas behind one Service: a follow-up (previous_response_id) may reach any,
    so none keeps stored responses in its own memory; they use the etcd and cluster name the
    coordinators' membership uses."""
    deployment = _named("Deployment", "splitserve-gateway")
    assert deployment["spec"]["replicas"] > 1
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    args = _parsed_args(container)
    assert args.response_store == "etcd"
    config = _named("ConfigMap", "splitserve-config")["data"]
    assert args.etcd_endpoints == config["SPLITSERVE_ETCD_ENDPOINTS"]
    assert args.cluster_name == config["SPLITSERVE_CLUSTER_NAME"]


def test_the_gateway_reaches_every_ready_coordinator_by_dns() -> None:
    [container] = _named("Deployment", "splitserve-gateway")["spec"]["template"]["spec"][
        "containers"
    ]
    [target] = _parsed_args(container).coordinator  # one model: one --coordinator
    match = re.fullmatch(r"dns:///([a-z0-9-]+):(\d+)", target)
    assert match, f"--coordinator {target}: one dns:/// name resolving to every coordinator"
    service = _named("Service", match[1])
    assert service["spec"]["clusterIP"] == "None", "a headless Service: DNS lists every pod"
    assert not service["spec"].get("publishNotReadyAddresses", False)
    [coordinators] = _selected_workloads(service["spec"]["selector"])
    [coordinator] = coordinators["spec"]["template"]["spec"]["containers"]
    assert _role(coordinator) == "coordinator"
    port = next(p for p in service["spec"]["ports"] if p["port"] == int(match[2]))
    assert _container_port(coordinator, port["targetPort"]) == _parsed_args(coordinator).port


# ---------------------------------------------------------------- tests: probes and shutdown


def test_every_container_has_startup_liveness_and_readiness_probes_on_its_ports() -> None:
    for _workload, container in _containers():
        role = _role(container)
        for kind in PROBES:
            check = container[kind]
            where = f"{container['name']} {kind}"
            if "httpGet" in check or "tcpSocket" in check:
                port = (check.get("httpGet") or check["tcpSocket"])["port"]
                assert _container_port(container, port), f"{where}: no port {port!r}"
            elif "grpc" in check:
                assert role == "coordinator", f"{where}: only the public port takes it"
                args = _parsed_args(container)
                assert check["grpc"]["port"] == args.port, f"{where}: not the public port"
                assert not args.health_needs_key, f"{where}: health would need an API key"
            else:
                _check_exec_probe(container, kind, check)


def _check_exec_probe(container: Doc, kind: str, check: Doc) -> None:
    """An exec probe is ``splitserve probe`` at one of the role's own gRPC ports, with the
    cluster credential in its environment, ``--alive`` for liveness, and a check deadline
    the kubelet's timeout allows."""
    where = f"{container['name']} {kind}"
    command = check["exec"]["command"]
    assert command[:3] == PROBE_COMMAND, f"{where}: {command}"
    env = _container_env(container)
    try:
        probe_args = probe.build_parser(env).parse_args(command[3:])
    except SystemExit:
        pytest.fail(f"{where}: `splitserve probe` refuses {command[3:]}")
    host, port = probe_args.address.rsplit(":", 1)
    args = _parsed_args(container)
    assert host == "127.0.0.1" and _container_port(container, int(port)), where
    assert int(port) in {args.port, getattr(args, "internal_port", None)}, where
    assert probe_args.cluster_token == VALID_TOKEN, f"{where}: no {TOKEN_ENV} in the container"
    assert probe_args.alive == (kind == "livenessProbe"), where
    assert probe_args.timeout < check.get("timeoutSeconds", 1), where


def test_liveness_and_startup_never_depend_on_other_pods() -> None:
    """Only readiness may ask for a decode worker (the gateway's /health, the coordinator's
    public health): a cluster without workers must restart nothing."""
    for _workload, container in _containers():
        for kind in ("startupProbe", "livenessProbe"):
            check = container[kind]
            assert "grpc" not in check, container["name"]
            assert check.get("httpGet", {}).get("path") != "/health", container["name"]


def test_the_grace_period_outlasts_prestop_and_the_drain() -> None:
    for workload in _of_kind(*WORKLOAD_KINDS):
        spec = workload["spec"]["template"]["spec"]
        grace = spec.get("terminationGracePeriodSeconds", 30)
        for container in spec["containers"]:
            if _role(container) is None:
                continue
            drain = _parsed_args(container).drain_timeout
            needed = _prestop_seconds(container) + drain + SHUTDOWN_MARGIN_S
            assert grace >= needed, f"{workload['metadata']['name']}: {grace} s < {needed} s"


# ---------------------------------------------------------------- tests: secrets


def _secret_references() -> Iterator[tuple[str, str | None]]:
    """(Secret name, key or None for a whole-Secret volume) of every reference."""
    for workload in _of_kind(*WORKLOAD_KINDS):
        spec = workload["spec"]["template"]["spec"]
        for volume in spec.get("volumes", []):
            if "secret" in volume:
                yield volume["secret"]["secretName"], None
        for container in spec["containers"]:
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref is not None:
                    yield ref["name"], ref["key"]


def test_every_referenced_secret_and_key_exists() -> None:
    references = list(_secret_references())
    assert {name for name, _ in references} == {
        "splitserve-cluster-token",
        "splitserve-api-keys",
    }
    for name, key in references:
        secret = _named("Secret", name)
        if key is not None:
            assert key in secret["stringData"], f"Secret {name} has no key {key}"


def test_the_api_keys_file_is_the_mounted_secret() -> None:
    for workload in _of_kind(*WORKLOAD_KINDS):
        spec = workload["spec"]["template"]["spec"]
        volumes = {volume["name"]: volume for volume in spec.get("volumes", [])}
        for container in spec["containers"]:
            if _role(container) not in ("gateway", "coordinator"):
                continue
            keys_file = Path(_parsed_args(container).api_keys_file)
            [mount] = [
                m for m in container["volumeMounts"] if keys_file.parent == Path(m["mountPath"])
            ]
            secret = _named("Secret", volumes[mount["name"]]["secret"]["secretName"])
            assert keys_file.name in secret["stringData"]


def test_every_role_that_needs_the_cluster_token_gets_it_and_no_other_does() -> None:
    for _workload, container in _containers():
        role = _role(container)
        if role is None:
            continue
        has_token = TOKEN_ENV in _container_env(container)
        assert has_token == (role != "gateway"), role


def test_the_secret_placeholders_are_refused_by_the_roles() -> None:
    """A forgotten replacement fails closed: the token is no valid credential and the keys
    file no valid keys file (so the gateway does not fall back to "no key needed")."""
    with pytest.raises(ValueError):
        ClusterCredential(_secret_value("splitserve-cluster-token", "token"))
    with pytest.raises(ValueError):
        ApiKeys.parse(_secret_value("splitserve-api-keys", "keys").splitlines())
