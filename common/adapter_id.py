"""How a LoRA adapter is named across the cluster (torch-free).

A worker serves each adapter under a name that requests use (their ``model``) and announces
it with a digest of its files (``engine/lora.py:adapter_digest``). The digest, not the name,
is the adapter's identity wherever KV is kept or moved: a prompt's prefix hashes start at a
root of the digest (``common/blocks.py:prefix_root``), so KV computed with one version of an
adapter is never served to a request of another version loaded later under the same name.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.common.errors import InvalidRequestError
from splitserve.common.sampling_params import MAX_ADAPTER_NAME_CHARS


@dataclass(frozen=True)
class AdapterId:
    """A LoRA adapter a worker serves (``engine/lora.py``): the name requests use for it, and
    a digest of its files. Requests of an adapter go only to workers that hold it under one
    digest: a prompt's KV computed by one is decoded by another."""

    name: str
    digest: str


@dataclass(frozen=True)
class WantedAdapter:
    """A LoRA adapter loaded at runtime that every worker of the model is to serve
    (``coordinator/runtime_adapters.py``): what the workers served when it was loaded, and
    the path each worker's ``--lora-dir`` resolves, so a worker that joins later reads the
    same files (it must find the same ``adapter.digest`` there)."""

    adapter: AdapterId
    path: str


def check_adapter_name(name: str) -> None:
    """``InvalidRequestError`` (param ``lora_name``) for a name no request could use."""
    if not name or len(name) > MAX_ADAPTER_NAME_CHARS:
        raise InvalidRequestError(
            f"lora_name must be 1 to {MAX_ADAPTER_NAME_CHARS} characters", "lora_name"
        )
