"""Put first on PYTHONPATH, this makes an interpreter lack what the lent GPU machines' image
lacks (../shared/gpu.md: no HTTP stack; the GPU scripts serve over gRPC only), so the dry run
of ``bench/gpu/run.sh`` fails here where the real run would fail there: an import of the HTTP
stack on the path of ``splitserve up`` once cost a GPU loan's serving step."""

from __future__ import annotations

import importlib.abc
import sys

ABSENT_ON_THE_GPU_IMAGE = frozenset({"starlette", "fastapi", "uvicorn", "sse_starlette", "openai"})


class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201 (the finder protocol)
        if name.partition(".")[0] in ABSENT_ON_THE_GPU_IMAGE:
            raise ModuleNotFoundError(f"No module named {name!r} (absent on the GPU image)")
        return None


sys.meta_path.insert(0, _Absent())
