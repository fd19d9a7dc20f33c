"""The Kubernetes manifests in ``deploy/base``, checked without a cluster.

Rendered as ``kubectl apply -k deploy/base`` would: the files ``kustomization.yaml`` lists,
with its ``namespace`` set on every namespaced object (the kustomization uses nothing else,
and a test keeps it that way). Then:

- every built-in object (Deployment, StatefulSet, Service, Secret, ...) validates against the
  Kubernetes JSON schemas of ``K8S_VERSIONS`` (PyPI ``kubernetes-validate``, strict: an
  unknown field fails);
- the two custom resources, which have no built-in schema, validate against minimal schemas
  written here (``SCALED_OBJECT_SCHEMA``, ``SERVICE_MONITOR_SCHEMA``: required fields, known
  fields only, value types), and the autoscaling behaviour a ScaledObject hands to its HPA
  validates against the HorizontalPodAutoscaler schema;
- the wiring holds: every container's arguments and ``SPLITSERVE_*`` variables parse with its
  role's real parser; every Service, PodDisruptionBudget, NetworkPolicy and the ServiceMonitor
  selects pods or Services that exist, on ports they have; probes name ports the container
  has, exec probes parse as ``splitserve probe`` and carry the credential; the grace period
  outlasts preStop + ``--drain-timeout``; referenced Secrets and keys exist, and their
  placeholders are refused by the code that reads them; autoscaling queries name metrics the
  workers export, with labels they carry.

Not covered: anything a cluster does (scheduling, DNS, probes running, KEDA and Prometheus
reading these objects, the image itself).
"""

from __future__ import annotations

import argparse
import copy
import functools
import math
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client import CollectorRegistry

from splitserve.common.api_keys import ApiKeys
from splitserve.common.env_flags import env_name
from splitserve.engine.engine_report import EngineReport
from splitserve.launch import probe
from splitserve.proto.cluster_auth import TOKEN_ENV, ClusterCredential

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "deploy" / "base"
K8S_VERSIONS = ("1.29", "1.31")
"""Schemas validated against: native gRPC probes are GA from 1.27; 1.29 is the oldest
release here, 1.31 a current one."""
CUSTOM_KINDS = {"ScaledObject", "ServiceMonitor"}
CLUSTER_SCOPED_KINDS = {"Namespace"}
WORKLOAD_KINDS = {"Deployment", "StatefulSet"}
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")
PROBE_COMMAND = ["python", "-m", "splitserve.launch.probe"]
SHUTDOWN_MARGIN_S = 5
"""Seconds a pod's grace period must leave after preStop + ``--drain-timeout`` (closing the
servers, the engine and the transport)."""
PROMETHEUS_TARGET_LABELS = {"namespace", "pod", "service", "endpoint", "container", "job"}
"""Labels a ServiceMonitor's scrape adds to every series (besides the exported ones)."""
VALID_TOKEN = "a-valid-cluster-token-for-parsing-0123"
ROLE_LABEL = "splitserve.io/role"
WORKER_ROLES = ("prefill", "decode")

Doc = dict[str, Any]


# ---------------------------------------------------------------- rendering


def _kustomization() -> Doc:
    """``deploy/base/kustomization.yaml``."""
    return yaml.safe_load((BASE / "kustomization.yaml").read_text())


@functools.cache
def _rendered_cached() -> tuple[Doc, ...]:
    """The rendering, read once (``_rendered`` hands out copies)."""
    kustomization = _kustomization()
    namespace = kustomization.get("namespace")
    docs: list[Doc] = []
    for resource in kustomization["resources"]:
        docs += [doc for doc in yaml.safe_load_all((BASE / resource).read_text()) if doc]
    docs += _generated_config_maps(kustomization)
    for doc in docs:
        if namespace and doc["kind"] not in CLUSTER_SCOPED_KINDS:
            doc["metadata"]["namespace"] = namespace
    return tuple(docs)


def _generated_config_maps(kustomization: Doc) -> list[Doc]:
    """The ConfigMaps of ``configMapGenerator`` as kustomize makes them from ``files`` (one
    key per file, its base name) with ``generatorOptions``' labels; the test renders no other
    generator input and no name suffix hash (``disableNameSuffixHash`` must be set)."""
    generators = kustomization.get("configMapGenerator", [])
    options = kustomization.get("generatorOptions", {})
    if generators:
        assert options.get("disableNameSuffixHash") is True, "a hash the test does not render"
    maps = []
    for generator in generators:
        assert set(generator) <= {"name", "files"}, "a generator input the test does not render"
        data = {Path(file).name: (BASE / file).read_text() for file in generator["files"]}
        metadata = {"name": generator["name"], "labels": dict(options.get("labels", {}))}
        maps.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data})
    return maps


def _rendered() -> list[Doc]:
    """Every object ``kubectl apply -k deploy/base`` would create (a fresh copy)."""
    return copy.deepcopy(list(_rendered_cached()))


def _of_kind(*kinds: str) -> list[Doc]:
    """The rendered objects of these kinds."""
    return [doc for doc in _rendered() if doc["kind"] in kinds]


def _named(kind: str, name: str) -> Doc:
    """The rendered object of ``kind`` called ``name`` (fails the test when there is none)."""
    found = [doc for doc in _of_kind(kind) if doc["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name!r}: {len(found)} found"
    return found[0]


def _pod_labels(workload: Doc) -> dict[str, str]:
    """The labels of a workload's pods (its template's)."""
    return workload["spec"]["template"]["metadata"]["labels"]


def _containers() -> Iterator[tuple[Doc, Doc]]:
    """(workload, container) for every container of every Deployment and StatefulSet."""
    for workload in _of_kind(*WORKLOAD_KINDS):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            yield workload, container


def _selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Whether a label selector (a Service's plain map, or matchLabels / matchExpressions)
    selects ``labels``."""
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions", []):
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values", [])
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and labels.get(key) in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


def _selected_workloads(selector: Mapping[str, Any]) -> list[Doc]:
    """The Deployments and StatefulSets whose pods ``selector`` selects."""
    return [w for w in _of_kind(*WORKLOAD_KINDS) if _selects(selector, _pod_labels(w))]


def _container_port(container: Doc, port: int | str) -> int | None:
    """The number of ``port`` (a name or a number) among the container's ports; None."""
    for declared in container.get("ports", []):
        if port in (declared.get("name"), declared["containerPort"]):
            return declared["containerPort"]
    return None


def _role(container: Doc) -> str | None:
    """The splitserve role a container runs (``splitserve <role>``); None for others."""
    command = container.get("command", [])
    return command[1] if command[:1] == ["splitserve"] else None


# ---------------------------------------------------------------- the roles' own parsers


def _role_parser(role: str, env: Mapping[str, str]) -> argparse.ArgumentParser:
    """The parser ``splitserve <role>`` uses, reading ``SPLITSERVE_*`` twins from ``env``."""
    if role in WORKER_ROLES:
        from splitserve.worker.process import add_worker_args  # loads torch: import late

        parser = argparse.ArgumentParser(prog=f"splitserve {role}")
        add_worker_args(parser, env)
        return parser
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:  # these parsers read the process environment while they are built
        if role == "coordinator":
            from splitserve.coordinator.main import build_parser
        else:
            assert role == "gateway", role
            from splitserve.gateway.main import build_parser
        return build_parser()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _env_twins(parser: argparse.ArgumentParser) -> set[str]:
    """The ``SPLITSERVE_*`` names of a parser's ``--flags``."""
    return {
        env_name(option)
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--")
    }


def _secret_value(name: str, key: str) -> str:
    """The value the manifests put under ``key`` of Secret ``name``."""
    return _named("Secret", name)["stringData"][key]


def _container_env(container: Doc) -> dict[str, str]:
    """The environment Kubernetes would give ``container``: ConfigMaps (envFrom), literal
    values with ``$(VAR)`` expanded, downward-API fields as stand-ins, a Secret's key as a
    valid token (the manifests' placeholders are refused on purpose: see the secrets tests)
    once the key is known to exist."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(_named("ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = _expand(var["value"], env)
            continue
        source = var["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            _secret_value(ref["name"], ref["key"])  # fails the test when it does not exist
            env[var["name"]] = VALID_TOKEN
        elif "fieldRef" in source:
            env[var["name"]] = {"status.podIP": "10.1.2.3"}.get(
                source["fieldRef"]["fieldPath"], "pod-0"
            )
        else:
            ref = source["resourceFieldRef"]
            quantity = container["resources"]["limits"][ref["resource"].split(".", 1)[1]]
            env[var["name"]] = str(math.ceil(float(quantity)))
    return env


def _expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion (an undefined variable stays as written)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), text)


def _parsed_args(container: Doc) -> argparse.Namespace:
    """A splitserve container's command line parsed by its role's parser, in its environment."""
    role = _role(container)
    assert role is not None
    env = _container_env(container)
    args = [_expand(arg, env) for arg in container.get("args", [])]
    try:
        return _role_parser(role, env).parse_args(args)
    except SystemExit:
        pytest.fail(f"splitserve {role} refuses its arguments {args}")


def _prestop_seconds(container: Doc) -> float:
    """Seconds a container's preStop hook waits (``sleep N``); 0 without one."""
    hook = container.get("lifecycle", {}).get("preStop")
    if hook is None:
        return 0.0
    command = hook["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, f"unexpected preStop {command}"
    return float(command[1])


# ---------------------------------------------------------------- custom resources

_STRING = {"type": "string", "minLength": 1}
_NUMBER_TEXT = {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"}
SCALED_OBJECT_SCHEMA: Doc = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "apiVersion": _STRING,
                        "kind": _STRING,
                        "name": _STRING,
                        "envSourceContainerName": _STRING,
                    },
                },
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "idleReplicaCount": {"type": "integer", "minimum": 0},
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "initialCooldownPeriod": {"type": "integer", "minimum": 0},
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {"name": _STRING, "behavior": {"type": "object"}},
                        },
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "scalingModifiers": {"type": "object"},
                    },
                },
                "fallback": {"type": "object"},
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": _STRING,
                            "name": _STRING,
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "useCachedMetrics": {"type": "boolean"},
                            "authenticationRef": {"type": "object"},
                            "metadata": {
                                "type": "object",
                                "additionalProperties": {"type": "string"},
                            },
                        },
                    },
                },
            },
        },
    },
}
"""What KEDA 2's ScaledObject CRD takes (the fields used here, and their neighbours), and
every value a string where KEDA wants one (trigger metadata)."""
PROMETHEUS_TRIGGER_SCHEMA: Doc = {
    "type": "object",
    "required": ["serverAddress", "query", "threshold"],
    "properties": {
        "serverAddress": {"type": "string", "pattern": "^https?://"},
        "query": _STRING,
        "threshold": _NUMBER_TEXT,
        "activationThreshold": _NUMBER_TEXT,
    },
}
SERVICE_MONITOR_SCHEMA: Doc = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "additionalProperties": {"type": "string"},
                        },
                        "matchExpressions": {"type": "array"},
                    },
                },
                "namespaceSelector": {"type": "object"},
                "jobLabel": _STRING,
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["port"],
                        "additionalProperties": False,
                        "properties": {
                            "port": _STRING,
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": r"^[0-9]+(ms|s|m|h)$"},
                            "scrapeTimeout": {
                                "type": "string",
                                "pattern": r"^[0-9]+(ms|s|m|h)$",
                            },
                            "honorLabels": {"type": "boolean"},
                            "relabelings": {"type": "array"},
                            "metricRelabelings": {"type": "array"},
                            "tlsConfig": {"type": "object"},
                        },
                    },
                },
            },
        },
    },
}
"""What the Prometheus Operator's ServiceMonitor CRD takes (the fields used here and their
neighbours); endpoints name Service ports by name."""


# ---------------------------------------------------------------- tests: rendering, schemas


def test_the_kustomization_lists_every_manifest_and_uses_only_what_the_test_renders() -> None:
    kustomization = _kustomization()
    allowed = {"apiVersion", "kind", "namespace", "resources", "configMapGenerator"}
    assert set(kustomization) <= allowed | {"generatorOptions"}, (
        "a kustomize feature the test does not render"
    )
    assert kustomization["kind"] == "Kustomization"
    listed = kustomization["resources"]
    on_disk = sorted(p.name for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == on_disk and len(set(listed)) == len(listed)
    assert _named("Namespace", kustomization["namespace"])


def test_names_are_unique_per_kind() -> None:
    keys = [(doc["kind"], doc["metadata"]["name"]) for doc in _rendered()]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_built_in_objects_validate_against_the_kubernetes_schemas(version: str) -> None:
    errors = []
    validated = set()
    for doc in _rendered():
        if doc["kind"] in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            where = "/".join(str(part) for part in error.path)
            errors.append(f"{doc['kind']} {doc['metadata']['name']}: {where}: {error.message}")
        validated.add(doc["kind"])
    assert not errors, "\n".join(errors)
    assert validated >= {
        "Namespace",
        "ConfigMap",
        "Secret",
        "Service",
        "StatefulSet",
        "Deployment",
        "PodDisruptionBudget",
        "NetworkPolicy",
    }


def test_the_validation_is_strict() -> None:
    """An unknown field fails it (a typo in a probe is no silent no-op)."""
    deployment = _named("Deployment", "splitserve-gateway")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGets"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)


def test_custom_resources_validate_against_minimal_schemas() -> None:
    scaled = _of_kind("ScaledObject")
    monitors = _of_kind("ServiceMonitor")
    assert len(scaled) == 2 and len(monitors) == 1
    for doc in scaled:
        jsonschema.validate(doc, SCALED_OBJECT_SCHEMA)
        for trigger in doc["spec"]["triggers"]:
            assert trigger["type"] == "prometheus"
            jsonschema.validate(trigger["metadata"], PROMETHEUS_TRIGGER_SCHEMA)
    for doc in monitors:
        jsonschema.validate(doc, SERVICE_MONITOR_SCHEMA)
    with pytest.raises(jsonschema.ValidationError):  # the schemas can fail
        jsonschema.validate({**scaled[0], "spec": {"scaleTargetRef": {}}}, SCALED_OBJECT_SCHEMA)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_autoscalers_keda_makes_validate_as_hpas(version: str) -> None:
    """KEDA creates an HPA from each ScaledObject: replica bounds, target and behaviour."""
    for scaled in _of_kind("ScaledObject"):
        spec = scaled["spec"]
        hpa = {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": f"keda-hpa-{scaled['metadata']['name']}"},
            "spec": {
                "scaleTargetRef": spec["scaleTargetRef"],
                "minReplicas": max(1, spec["minReplicaCount"]),
                "maxReplicas": spec["maxReplicaCount"],
                "behavior": spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"],
            },
        }
        kubernetes_validate.validate(hpa, version, strict=True)
        assert spec["minReplicaCount"] <= spec["maxReplicaCount"]


# ---------------------------------------------------------------- tests: selectors and ports


def test_every_service_selects_pods_on_ports_they_declare() -> None:
    for service in _of_kind("Service"):
        name = service["metadata"]["name"]
        workloads = _selected_workloads(service["spec"]["selector"])
        assert workloads, f"Service {name} selects no pods"
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for workload in workloads:
                containers = workload["spec"]["template"]["spec"]["containers"]
                assert any(_container_port(c, target) for c in containers), (
                    f"Service {name}: {workload['metadata']['name']} has no port {target!r}"
                )


def test_pod_disruption_budgets_and_network_policies_select_pods() -> None:
    for doc in _of_kind("PodDisruptionBudget"):
        assert _selected_workloads(doc["spec"]["selector"]), doc["metadata"]["name"]
    for policy in _of_kind("NetworkPolicy"):
        workloads = _selected_workloads(policy["spec"]["podSelector"])
        assert workloads, policy["metadata"]["name"]
        for rule in policy["spec"]["ingress"]:
            for peer in rule["from"]:
                if "podSelector" in peer:
                    assert _selected_workloads(peer["podSelector"])
            for port in rule.get("ports", []):
                for workload in workloads:
                    containers = workload["spec"]["template"]["spec"]["containers"]
                    assert any(_container_port(c, port["port"]) for c in containers)


def test_the_service_monitor_scrapes_each_role_once_on_a_port_it_has() -> None:
    [monitor] = _of_kind("ServiceMonitor")
    endpoint_ports = {endpoint["port"] for endpoint in monitor["spec"]["endpoints"]}
    selected = [
        s
        for s in _of_kind("Service")
        if _selects(monitor["spec"]["selector"], s["metadata"].get("labels", {}))
    ]
    scraped_components = set()
    used_ports = set()
    for service in selected:
        ports = {port["name"] for port in service["spec"]["ports"]} & endpoint_ports
        assert len(ports) == 1, f"{service['metadata']['name']} exposes {ports} to scrape"
        used_ports |= ports
        for workload in _selected_workloads(service["spec"]["selector"]):
            component = _pod_labels(workload)["app.kubernetes.io/component"]
            assert component not in scraped_components, f"{component} is scraped twice"
            scraped_components.add(component)
    assert used_ports == endpoint_ports
    assert scraped_components == {"etcd", "coordinator", "prefill", "decode", "gateway"}


def test_the_scraped_paths_are_where_the_roles_serve_metrics() -> None:
    """Workers and coordinators serve /metrics on --metrics-port; the gateway on its port."""
    [monitor] = _of_kind("ServiceMonitor")
    assert {endpoint["path"] for endpoint in monitor["spec"]["endpoints"]} == {"/metrics"}
    for _workload, container in _containers():
        role = _role(container)
        if role is None:
            continue
        args = _parsed_args(container)
        if role == "gateway":
            assert _container_port(container, "http") == args.port
        else:
            assert _container_port(container, "metrics") == args.metrics_port


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


# ---------------------------------------------------------------- tests: autoscaling


def _exported_worker_series(role: str) -> dict[str, set[str]]:
    """Series name -> label names that a worker of ``role`` exports from its engine."""
    from splitserve.worker.metrics import install_engine_metrics  # loads torch: import late

    engine = SimpleNamespace(
        latest_report=EngineReport(),  # an engine at rest
        add_report_listener=lambda listener: None,
        step_threads=None,  # a worker that neither lends nor borrows cores (the default)
    )
    registry = CollectorRegistry()
    install_engine_metrics(registry, engine, "model", role)  # type: ignore[arg-type]
    series: dict[str, set[str]] = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.labels.get("role") == role:
                series[sample.name] = set(sample.labels)
    return series


def test_autoscaling_targets_the_worker_deployments_on_metrics_they_export() -> None:
    namespace = _kustomization()["namespace"]
    targets = set()
    for scaled in _of_kind("ScaledObject"):
        ref = scaled["spec"]["scaleTargetRef"]
        assert ref.get("kind", "Deployment") == "Deployment"
        deployment = _named("Deployment", ref["name"])
        role = deployment["metadata"]["labels"][ROLE_LABEL]
        assert scaled["metadata"]["labels"][ROLE_LABEL] == role
        targets.add(role)
        exported = _exported_worker_series(role)
        for trigger in scaled["spec"]["triggers"]:
            query = trigger["metadata"]["query"]
            selectors = re.findall(r"(splitserve_\w+)\{([^}]*)\}", query)
            assert selectors, f"{query}: no splitserve series"
            for name, matchers in selectors:
                assert name in exported, f"{query}: {role} workers export no {name}"
                labels = dict(re.findall(r'(\w+)="([^"]*)"', matchers))
                assert labels.get("role") == role and labels.get("namespace") == namespace
                unknown = set(labels) - exported[name] - PROMETHEUS_TARGET_LABELS
                assert not unknown, f"{query}: no label {unknown} on {name}"
    assert targets == set(WORKER_ROLES)
