"""Where workers live in etcd: ``/splitserve/<cluster>/workers/<worker_id>``.

One cluster's keys never lie under another's prefix (cluster names hold no "/"), so several
clusters can share one etcd. The value is the serialized ``WorkerInfo``
(``proto/convert.py:worker_info_to_bytes``).
"""

from __future__ import annotations

ROOT = "/splitserve"


def workers_prefix(cluster: str) -> bytes:
    """The prefix of every worker key of ``cluster``; ``ValueError`` for an empty name or one
    with a "/"."""
    if not cluster or "/" in cluster:
        raise ValueError(f"cluster name must be non-empty without '/': {cluster!r}")
    return f"{ROOT}/{cluster}/workers/".encode()


def worker_key(cluster: str, worker_id: str) -> bytes:
    """The key of one worker; ``ValueError`` for an empty id."""
    if not worker_id:
        raise ValueError("worker_id must be non-empty")
    return workers_prefix(cluster) + worker_id.encode()


def worker_id_of(prefix: bytes, key: bytes) -> str:
    """The worker id of ``key`` under ``prefix`` (as ``workers_prefix`` made it)."""
    return key[len(prefix) :].decode(errors="replace")
