"""The architecture page stays true, and the edges stay where it says they are.

``docs/architecture.md`` names code as ``file.py:name`` in backticks; every such name must
resolve to a module attribute (function, class, method) that exists. The request's walk must
be there as a numbered list whose every step names code. Only ``proto/``, the servicers and
the processes' ``main`` modules (server registration), and the client (the public API's edge)
import the generated wire modules: everything else passes domain objects.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "architecture.md"
REFERENCE = re.compile(r"`(?P<path>[a-z_]+(?:/[a-z_0-9]+)*\.py):(?P<name>[A-Za-z_][\w.]*)`")
WALK_STEP = re.compile(r"^(?P<number>\d+)\. \*\*", re.MULTILINE)
WIRE_MODULES = ("splitserve.proto.splitserve.v1", "splitserve.proto.etcd")
"""Generated modules: splitserve's own API and the subset of etcd's that the etcd client calls."""
PACKAGES = ("common", "engine", "kernels", "transfer", "worker", "prefill", "decode")
PACKAGES += ("coordinator", "gateway", "client", "launch", "proto", "discovery")


def _references() -> list[tuple[str, str]]:
    return [(m["path"], m["name"]) for m in REFERENCE.finditer(PAGE.read_text())]


def _module_of(path: str) -> str:
    return "splitserve." + path.removesuffix(".py").replace("/", ".")


def test_the_page_names_code_and_is_linked_from_the_readme() -> None:
    assert len(_references()) >= 40
    assert "docs/architecture.md" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize(("path", "name"), sorted(set(_references())))
def test_every_named_function_exists(path: str, name: str) -> None:
    assert (ROOT / path).is_file(), f"{path} does not exist"
    target: object = importlib.import_module(_module_of(path))
    for part in name.split("."):
        assert hasattr(target, part), f"{path}:{name}: no {part!r}"
        target = getattr(target, part)


def test_the_request_walk_is_numbered_and_every_step_names_code() -> None:
    text = PAGE.read_text()
    walk = text.split("## One request's way", 1)[1].split("\n## ", 1)[0]
    steps = re.split(r"\n(?=\d+\. \*\*)", walk)[1:]
    numbers = [int(m["number"]) for m in WALK_STEP.finditer(walk)]
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) >= 8
    for step in steps:
        assert REFERENCE.search(step), f"a step names no code: {step[:80]!r}"


def _is_wire(module: str) -> bool:
    """A generated package or a module in one (not ``splitserve.proto.etcd_client``)."""
    return any(module == wire or module.startswith(f"{wire}.") for wire in WIRE_MODULES)


def _wire_importers() -> list[str]:
    importers = []
    for package in PACKAGES:
        for source in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(source.read_text())
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                if any(_is_wire(name) for name in names):
                    importers.append(str(source.relative_to(ROOT)))
                    break
    return importers


def test_only_the_edges_touch_proto_messages() -> None:
    offenders = [
        path
        for path in _wire_importers()
        if not path.startswith(("proto/", "client/"))
        and not Path(path).name.endswith(("servicer.py", "main.py"))
    ]
    assert not offenders, f"import the wire outside proto/ and the servicers: {offenders}"
