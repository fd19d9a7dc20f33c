"""The Kubernetes manifests in ``deploy/base``, checked without a cluster: the objects, their
schemas and what selects, scrapes and scales what. What the pods' containers run and get
(command lines, environment, probes, shutdown, Secrets) is checked in
``test_deploy_containers.py``; the rendering both use is ``deploy_support.py``.

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
- the selection holds: every Service, PodDisruptionBudget, NetworkPolicy and the ServiceMonitor
  selects pods or Services that exist, on ports they have; the ServiceMonitor scrapes each
  role once, where the role serves its metrics; autoscaling queries name metrics the workers
  export, with labels they carry.

Not covered: anything a cluster does (scheduling, DNS, probes running, KEDA and Prometheus
reading these objects, the image itself).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import jsonschema
import kubernetes_validate
import pytest
from prometheus_client import CollectorRegistry

from splitserve.coordinator.capacity import DesiredWorkers
from splitserve.coordinator.metrics import CoordinatorMetrics
from splitserve.coordinator.registry import WorkerRegistry
from splitserve.engine.engine_report import EngineReport
from tests.deploy_support import (
    BASE,
    K8S_VERSIONS,
    ROLE_LABEL,
    WORKER_ROLES,
    Doc,
    _container_port,
    _containers,
    _kustomization,
    _named,
    _of_kind,
    _parsed_args,
    _pod_labels,
    _rendered,
    _role,
    _selected_workloads,
    _selects,
)

CUSTOM_KINDS = {"ScaledObject", "ServiceMonitor"}
PROMETHEUS_TARGET_LABELS = {"namespace", "pod", "service", "endpoint", "container", "job"}
"""Labels a ServiceMonitor's scrape adds to every series (besides the exported ones)."""


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


def _exported_coordinator_series() -> dict[str, set[str]]:
    """The coordinator's series names and their labels (``splitserve_desired_workers`` has a
    ``role`` label naming the workers it sizes)."""
    registry = CollectorRegistry()
    CoordinatorMetrics(
        registry, "model", WorkerRegistry(), desired=lambda: DesiredWorkers(1.0, 1.0)
    )
    return {
        sample.name: set(sample.labels)
        for family in registry.collect()
        for sample in family.samples
    }


def test_autoscaling_targets_the_worker_deployments_on_metrics_they_export() -> None:
    """Each trigger reads a series the role's workers export, or the coordinators' sizing of
    that role (``splitserve_desired_workers{role}``)."""
    namespace = _kustomization()["namespace"]
    targets = set()
    for scaled in _of_kind("ScaledObject"):
        ref = scaled["spec"]["scaleTargetRef"]
        assert ref.get("kind", "Deployment") == "Deployment"
        deployment = _named("Deployment", ref["name"])
        role = deployment["metadata"]["labels"][ROLE_LABEL]
        assert scaled["metadata"]["labels"][ROLE_LABEL] == role
        targets.add(role)
        exported = _exported_worker_series(role) | _exported_coordinator_series()
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
