"""Generate the Python modules of ``splitserve/v1/*.proto`` (``make proto``; drift test).

protoc writes ``from splitserve.v1 import common_pb2``; the modules live in the package
``splitserve.proto.splitserve.v1``, so those imports are rewritten to the full path. Needs
``grpcio-tools`` (the ``test`` extra), pinned so that regenerating gives identical files.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
"""The folder holding ``splitserve/v1/*.proto`` (proto_path of protoc)."""
PACKAGE_DIR = PROTO_ROOT / "splitserve" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
_IMPORT = re.compile(r"^from splitserve\.v1 import ", re.MULTILINE)


def generate(out_root: Path) -> list[Path]:
    """Run protoc on every .proto into ``out_root/splitserve/v1``; return the written files."""
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PACKAGE_DIR.glob("*.proto"))
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
        path
        for path in (out_root / "splitserve" / "v1").iterdir()
        if path.name.endswith(GENERATED_SUFFIXES)
    )
    for path in written:
        text = _IMPORT.sub("from splitserve.proto.splitserve.v1 import ", path.read_text())
        path.write_text(text)
    return written


def generated_files() -> dict[str, str]:
    """Freshly generated modules by file name (nothing in the source tree is touched)."""
    with tempfile.TemporaryDirectory() as tmp:
        return {path.name: path.read_text() for path in generate(Path(tmp))}


def main() -> int:
    for name, text in generated_files().items():
        (PACKAGE_DIR / name).write_text(text)
        print(f"wrote {PACKAGE_DIR / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
