"""Generate the Python modules of the committed ``.proto`` files (``make proto``; drift tests).

Two sets, each a folder of ``.proto`` files under this one (the proto_path of protoc):
``splitserve/v1`` (splitserve's own API) and ``etcd`` (the subset of etcd v3's API that
``etcd_client.py`` calls). protoc writes imports such as ``from splitserve.v1 import
common_pb2``; the modules live in the package ``splitserve.proto.<folder>``, so those imports
are rewritten to the full path. Needs ``grpcio-tools`` (the ``test`` extra), pinned so that
regenerating gives identical files.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
"""The folder holding ``splitserve/v1/*.proto`` and ``etcd/*.proto`` (proto_path of protoc)."""
PACKAGE_DIR = PROTO_ROOT / "splitserve" / "v1"
ETCD_DIR = PROTO_ROOT / "etcd"
PACKAGE_DIRS = (PACKAGE_DIR, ETCD_DIR)
"""Every folder whose ``.proto`` files ``make proto`` compiles."""
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_root: Path, package_dir: Path = PACKAGE_DIR) -> list[Path]:
    """Run protoc on every .proto of ``package_dir`` into the same relative folder under
    ``out_root``; return the written files."""
    from grpc_tools import protoc

    relative = package_dir.relative_to(PROTO_ROOT)
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in package_dir.glob("*.proto"))
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    written = sorted(
        path for path in (out_root / relative).iterdir() if path.name.endswith(GENERATED_SUFFIXES)
    )
    package = ".".join(relative.parts)
    protoc_import = re.compile(rf"^from {re.escape(package)} import ", re.MULTILINE)
    for path in written:
        text = protoc_import.sub(f"from splitserve.proto.{package} import ", path.read_text())
        path.write_text(text)
    return written


def generated_files(package_dir: Path = PACKAGE_DIR) -> dict[str, str]:
    """Freshly generated modules of ``package_dir`` by file name (nothing in the source tree
    is touched)."""
    with tempfile.TemporaryDirectory() as tmp:
        return {path.name: path.read_text() for path in generate(Path(tmp), package_dir)}


def main() -> int:
    for package_dir in PACKAGE_DIRS:
        for name, text in generated_files(package_dir).items():
            (package_dir / name).write_text(text)
            print(f"wrote {package_dir / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
