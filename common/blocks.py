"""KV block arithmetic and prefix hashing shared by workers and the router (torch-free).

A block that is full of tokens is identified by a chained digest
``hash_i = H(hash_{i-1}, tokens of block i)``, so equal digests mean equal whole prefixes: a
worker's prefix cache keys its blocks so, and the coordinator's router estimates a prompt's
cached prefix on a worker with the same digests.

A request's ``cache_salt`` (``SamplingParams.cache_salt``) starts its chain at a root of its
own (``prefix_root``): its blocks' digests are other than any unsalted or otherwise salted
prompt's, so only requests with the same salt share cached blocks (vLLM's per-tenant
isolation of the prefix cache: no timing tells a tenant what another's prompts hold).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes
"""Digest identifying a full block by its tokens and all tokens before it."""

_ROOT_HASH: BlockHash = b"splitserve-prefix-root"


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` positions (ceiling division)."""
    return -(-num_tokens // block_size)


def prefix_root(cache_salt: str, adapter_digest: str = "") -> BlockHash | None:
    """The parent of a prompt's first block under ``cache_salt`` and the LoRA adapter whose
    files hash to ``adapter_digest`` (``common/adapter_id.py``; None, the common root, for
    neither): a request of an adapter computes other KV than the base model's for the same
    tokens, so its blocks are found only by requests of that adapter, and of its files (an
    adapter loaded again under its name with other files finds none of the old one's)."""
    if not cache_salt and not adapter_digest:
        return None
    digest = hashlib.blake2b(b"splitserve-cache-salt", digest_size=16)
    digest.update(cache_salt.encode("utf-8", "surrogatepass"))
    if adapter_digest:
        digest.update(b"\x00lora\x00" + adapter_digest.encode("utf-8", "surrogatepass"))
    return digest.digest()


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Digest of a full block chained with the digest of everything before it (``parent``
    None: the first block of an unsalted prompt; ``prefix_root`` for a salted one's)."""
    digest = hashlib.blake2b(parent or _ROOT_HASH, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, root: BlockHash | None = None
) -> list[BlockHash]:
    """Chained hashes of the prompt's full blocks (as the workers' prefix caches key them),
    from ``root`` (``prefix_root`` of the request's salt and adapter)."""
    hashes: list[BlockHash] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
