"""The architecture page stays true, and the edges stay where it says they are.

``docs/architecture.md`` names code as ``file.py:name`` in backticks; every such name must
resolve to a module attribute (function, class, method) that exists, and the file must define
the name's first part itself (not merely import it). The request's walk must
be there as a numbered list whose every step names code. Only ``proto/``, the servicers and
the processes' ``main`` modules (server registration), and the client (the public API's edge)
import the generated wire modules: everything else passes domain objects.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "architecture.md"
REFERENCE = re.compile(
    r"`(?P<path>[a-z_]+(?:/[a-z_0-9]+)*\.py):\s*(?P<name>[A-Za-z_]\w*(?:\.\s*[A-Za-z_]\w*)*)`"
)
"""A ``file.py:name`` in backticks; a line break may fall after the colon or a dot."""
WALK_STEP = re.compile(r"^(?P<number>\d+)\. \*\*", re.MULTILINE)
WIRE_MODULES = ("splitserve.proto.splitserve.v1", "splitserve.proto.etcd")
"""Generated modules: splitserve's own API and the subset of etcd's that the etcd client calls."""
PACKAGES = ("common", "engine", "kernels", "transfer", "worker", "prefill", "decode")
PACKAGES += ("coordinator", "gateway", "frontend", "client", "launch", "proto", "discovery")


def _references() -> list[tuple[str, str]]:
    text = PAGE.read_text()
    return [(m["path"], re.sub(r"\s+", "", m["name"])) for m in REFERENCE.finditer(text)]


def _module_of(path: str) -> str:
    return "splitserve." + path.removesuffix(".py").replace("/", ".")


def test_the_page_names_code_and_is_linked_from_the_readme() -> None:
    assert len(_references()) >= 40
    assert "docs/architecture.md" in (ROOT / "README.md").read_text()


@functools.cache
def _defined_names(path: str) -> frozenset[str]:
    """The names the file ``path`` defines (``_names_defined_in``); each file parsed once."""
    return _names_defined_in(ast.parse((ROOT / path).read_text()))


def _names_defined_in(tree: ast.Module) -> frozenset[str]:
    """The names ``tree`` binds at module level by a def, a class or an assignment (also inside
    a module-level ``if``/``try``/``with``), never by an import."""
    names: set[str] = set()
    statements = list(tree.body)
    while statements:
        statement = statements.pop()
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(statement.name)
        elif isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(statement, (ast.If, ast.Try, ast.With)):
            for block in ("body", "orelse", "finalbody"):
                statements += getattr(statement, block, [])
            for handler in getattr(statement, "handlers", []):
                statements += handler.body
    return frozenset(names)


@pytest.mark.parametrize(("path", "name"), sorted(set(_references())))
def test_every_named_function_exists(path: str, name: str) -> None:
    assert (ROOT / path).is_file(), f"{path} does not exist"
    defined_here = name.split(".")[0]
    assert defined_here in _defined_names(path), f"{path}:{name}: {path} does not define it"
    target: object = importlib.import_module(_module_of(path))
    for part in name.split("."):
        assert hasattr(target, part), f"{path}:{name}: no {part!r}"
        target = getattr(target, part)


def test_a_name_imported_into_the_cited_file_is_not_defined_there() -> None:
    """The check itself can fail: a name the file imports, even under an alias, is not one
    it defines."""
    source = (
        "from splitserve.engine.engine_report import StepTiming\n"
        "import splitserve.engine.llm as LLM\n"
        "LIMIT: int = 3\n"
        "if LIMIT:\n"
        "    def fallback() -> None: ...\n"
        "class EngineCore:\n"
        "    def step(self) -> None: ...\n"
    )
    assert _names_defined_in(ast.parse(source)) == {"LIMIT", "fallback", "EngineCore"}


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
    ("frontend",),
    ("launch",),
)
"""The package folders, lowest first. A module imports its own folder and lower layers only:
never a higher one, nor its peer in the same layer (prefill and decode share ``worker/``). A
module named in a string (``_named_modules``: started by ``importlib`` or ``-m``) counts as
imported."""
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


MODULE_NAME = re.compile(r"^(?P<module>splitserve(?:\.[a-z_0-9]+)+)(?::[a-z_]+)?$")
"""A string that is a module name, as ``importlib.import_module`` or a ``python -m`` argument
takes it (``splitserve.launch.probe``), or an entry point (``splitserve.launch.cli:main``)."""
RUN_MODULE = re.compile(r"(?:^|\s)-m\s+(?P<module>splitserve(?:\.[a-z_0-9]+)+)\b")
"""``-m splitserve.x`` inside a command line written as one string."""


def _named_modules(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, module) of every string constant that names a splitserve module (see
    ``MODULE_NAME`` and ``RUN_MODULE``): modules started by name are imports too. Docstrings
    and other bare string statements are prose and do not count."""
    prose = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant) or not isinstance(node.value, str):
            continue
        if id(node) in prose:
            continue
        whole = MODULE_NAME.match(node.value)
        named = [whole["module"]] if whole else RUN_MODULE.findall(node.value)
        found += [(node.lineno, module) for module in named]
    return found


def _violations_in(source: Path, tree: ast.Module) -> list[str]:
    package = source.relative_to(ROOT).parts[0]
    imports = [(line, module, "") for line, module in _imported_modules(source, tree)]
    imports += [(line, module, " (by name)") for line, module in _named_modules(tree)]
    violations = []
    for line, module, how in sorted(imports):
        target = _folder_of(module)
        if target is None or target == package or LAYER_OF[target] < LAYER_OF[package]:
            continue
        kind = "its peer" if LAYER_OF[target] == LAYER_OF[package] else "a higher"
        where = f"{source.relative_to(ROOT)}:{line}"
        violations.append(f"{where} ({package}/) imports {kind} {target}/: {module}{how}")
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


def test_the_layer_check_sees_modules_named_in_strings() -> None:
    """Starting a module by name is an import: ``importlib.import_module``, a table of module
    names and a ``-m`` command line are caught; docstrings and other prose are not."""
    source = ROOT / "engine" / "example.py"
    by_name = (
        '"""Started by splitserve.launch.up."""\n'
        "import importlib\n"
        'importlib.import_module("splitserve.coordinator.main")\n'
        'ROLES = {"up": "splitserve.launch.up:main", "own": "splitserve.engine.llm"}\n'
        'COMMAND = "python -m splitserve.gateway.main --port 8000"\n'
        'LOG = "started splitserve.decode.main"\n'
    )
    assert _violations_in(source, ast.parse(by_name)) == [
        "engine/example.py:3 (engine/) imports a higher coordinator/: "
        "splitserve.coordinator.main (by name)",
        "engine/example.py:4 (engine/) imports a higher launch/: splitserve.launch.up (by name)",
        "engine/example.py:5 (engine/) imports a higher gateway/: splitserve.gateway.main "
        "(by name)",
    ]
    assert not _violations_in(ROOT / "launch" / "example.py", ast.parse(by_name))
