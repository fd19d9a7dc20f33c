"""The committed generated gRPC modules (splitserve's API and the etcd subset): no drift from
the .proto files, one full set per .proto, and they import inside the ``splitserve.proto``
namespace with their service stubs."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from splitserve.proto import codegen

REGENERATE = "the committed modules are stale: run `make proto` and commit the result"


@pytest.mark.parametrize("package_dir", codegen.PACKAGE_DIRS, ids=lambda path: path.name)
def test_committed_modules_equal_freshly_generated(package_dir: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the test extra) regenerates")
    fresh = codegen.generated_files(package_dir)
    committed = {
        path.name: path.read_text()
        for path in package_dir.iterdir()
        if path.name.endswith(codegen.GENERATED_SUFFIXES)
    }
    assert sorted(committed) == sorted(fresh), REGENERATE
    stale = sorted(name for name, text in fresh.items() if committed[name] != text)
    assert not stale, f"{REGENERATE} (differs: {', '.join(stale)})"


@pytest.mark.parametrize("package_dir", codegen.PACKAGE_DIRS, ids=lambda path: path.name)
def test_every_proto_has_its_committed_modules(package_dir: Path) -> None:
    protos = sorted(path.stem for path in package_dir.glob("*.proto"))
    assert protos, f"no .proto files in {package_dir}"
    missing = [
        f"{stem}{suffix}"
        for stem in protos
        for suffix in codegen.GENERATED_SUFFIXES
        if not (package_dir / f"{stem}{suffix}").is_file()
    ]
    assert not missing, f"missing generated modules {missing}: run `make proto`"


@pytest.mark.parametrize(
    ("module", "services"),
    [
        ("common", []),
        ("coordinator", ["Coordinator", "Membership"]),
        ("worker", ["DecodeWorker", "PrefillWorker", "WorkerMonitor", "WorkerAdapters"]),
    ],
)
def test_generated_modules_import_with_their_services(module: str, services: list[str]) -> None:
    package = "splitserve.proto.splitserve.v1"
    messages = importlib.import_module(f"{package}.{module}_pb2")
    stubs = importlib.import_module(f"{package}.{module}_pb2_grpc")
    assert messages.DESCRIPTOR.package == "splitserve.v1"
    declared = set(messages.DESCRIPTOR.services_by_name)
    assert set(services) <= declared
    for service in declared:
        assert callable(getattr(stubs, f"{service}Stub"))
        assert isinstance(getattr(stubs, f"{service}Servicer"), type)
        assert callable(getattr(stubs, f"add_{service}Servicer_to_server"))


def test_cross_file_imports_resolve_inside_the_namespace() -> None:
    from splitserve.proto.splitserve.v1 import common_pb2, coordinator_pb2, worker_pb2

    dependencies = {dep.name for dep in coordinator_pb2.DESCRIPTOR.dependencies}
    assert {"splitserve/v1/common.proto", "splitserve/v1/worker.proto"} <= dependencies
    assert common_pb2.DESCRIPTOR.name in {dep.name for dep in worker_pb2.DESCRIPTOR.dependencies}
