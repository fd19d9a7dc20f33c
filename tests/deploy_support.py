"""The ``deploy/base`` manifests rendered as ``kubectl apply -k deploy/base`` would (the files
``kustomization.yaml`` lists, its ``configMapGenerator``, its ``namespace`` set on every
namespaced object), looked up by kind, name and selector; and what a container of them gets:
its environment as Kubernetes would build it and its command line parsed by its role's own
parser. Shared by ``test_deploy_manifests.py`` and ``test_deploy_custom_resources.py``.
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
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "deploy" / "base"
K8S_VERSIONS = ("1.29", "1.31")
"""Schemas validated against: native gRPC probes are GA from 1.27; 1.29 is the oldest
release here, 1.31 a current one."""
CLUSTER_SCOPED_KINDS = {"Namespace"}
WORKLOAD_KINDS = {"Deployment", "StatefulSet"}
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


def _secret_value(name: str, key: str) -> str:
    """The value the manifests put under ``key`` of Secret ``name``."""
    return _named("Secret", name)["stringData"][key]


def _container_env(container: Doc) -> dict[str, str]:
    """The environment Kubernetes would give ``container``: ConfigMaps (envFrom, or a key
    each), literal values with ``$(VAR)`` expanded, downward-API fields as stand-ins, a
    Secret's key as a valid token (the manifests' placeholders are refused on purpose: see
    the secrets tests) once the key is known to exist."""
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
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[var["name"]] = _named("ConfigMap", ref["name"])["data"][ref["key"]]
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
