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


LAYERS: tuple[tuple[str, ...], ...] = (
    ("common",),
    ("transfer",),
    ("kernels",),
    ("engine",),
    ("proto",),
    ("discovery",),
    ("worker",),
    ("prefill", "decode"),
    ("coordinator",),
    ("client",),
    ("gateway",),
    ("launch",),
)
"""The package folders, lowest first. A module imports its own folder and lower layers only:
never a higher one, nor its peer in the same layer (prefill and decode share ``worker/``)."""
LAYER_OF = {package: rank for rank, layer in enumerate(LAYERS) for package in layer}


def _folder_of(module: str) -> str | None:
    """``splitserve.engine.model`` -> ``engine``; None outside splitserve's package folders."""
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != "splitserve" or parts[1] not in LAYER_OF:
        return None
    return parts[1]


def _imported_modules(source: Path, tree: ast.Module) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``tree``, relative ones resolved."""
    package = ("splitserve", *source.relative_to(ROOT).parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.append((node.lineno, module))
    return found


def _violations_in(source: Path, tree: ast.Module) -> list[str]:
    package = source.relative_to(ROOT).parts[0]
    violations = []
    for line, module in _imported_modules(source, tree):
        target = _folder_of(module)
        if target is None or target == package or LAYER_OF[target] < LAYER_OF[package]:
            continue
        kind = "its peer" if LAYER_OF[target] == LAYER_OF[package] else "a higher"
        where = f"{source.relative_to(ROOT)}:{line}"
        violations.append(f"{where} ({package}/) imports {kind} {target}/: {module}")
    return violations


def _layer_violations() -> list[str]:
    violations = []
    for package in PACKAGES:
        for source in sorted((ROOT / package).rglob("*.py")):
            violations += _violations_in(source, ast.parse(source.read_text()))
    return violations


def test_every_package_folder_has_a_layer() -> None:
    folders = {path.parent.name for path in ROOT.glob("*/__init__.py")} - {"tests", "bench"}
    assert set(PACKAGES) == set(LAYER_OF) == folders


def test_folders_import_only_lower_layers() -> None:
    """common < transfer < kernels < engine < proto < discovery < worker < prefill, decode
    (peers) < coordinator < client < gateway < launch; generated modules included (they import
    only their own package)."""
    violations = _layer_violations()
    assert not violations, "imports against the folder order:\n" + "\n".join(violations)


def test_the_layer_check_sees_upward_and_peer_imports() -> None:
    """The check itself can fail: absolute, relative and peer imports upward are caught."""
    source = ROOT / "kernels" / "example.py"
    upward = "import splitserve.engine.model\nfrom ..worker import runtime\nfrom . import rotary\n"
    found = _violations_in(source, ast.parse(upward))
    assert [violation.split(" imports ")[1] for violation in found] == [
        "a higher engine/: splitserve.engine.model",
        "a higher worker/: splitserve.worker",
    ]
    peer = ast.parse("from splitserve.prefill.worker import PrefillWorker\n")
    assert _violations_in(ROOT / "decode" / "example.py", peer) == [
        "decode/example.py:1 (decode/) imports its peer prefill/: splitserve.prefill.worker"
    ]
    assert not _violations_in(ROOT / "launch" / "example.py", peer)
