"""Where a cluster lives in etcd.

- Workers: ``/splitserve/<cluster>/workers/<worker_id>``, the value the serialized
  ``WorkerInfo`` (``proto/convert.py:worker_info_to_bytes``).
- LoRA adapters loaded at runtime, per model: ``/splitserve/<cluster>/adapters/<model>/<name>``
  with the model and the adapter's name percent-encoded (either may hold a "/"), the value
  the serialized ``WantedAdapter`` (``proto/convert.py:wanted_adapter_to_bytes``).
- Stored Responses API responses: ``/splitserve/<cluster>/responses/<response id>``
  (percent-encoded), the value ``gateway/stored_responses.py``'s record, under a lease that
  ends it.

One cluster's keys never lie under another's prefix (cluster names hold no "/"), so several
clusters can share one etcd; one model's adapters never under another's.
"""

from __future__ import annotations

from urllib.parse import quote, unquote

ROOT = "/splitserve"


def _cluster_root(cluster: str) -> str:
    if not cluster or "/" in cluster:
        raise ValueError(f"cluster name must be non-empty without '/': {cluster!r}")
    return f"{ROOT}/{cluster}"


def workers_prefix(cluster: str) -> bytes:
    """The prefix of every worker key of ``cluster``; ``ValueError`` for an empty name or one
    with a "/"."""
    return f"{_cluster_root(cluster)}/workers/".encode()


def worker_key(cluster: str, worker_id: str) -> bytes:
    """The key of one worker; ``ValueError`` for an empty id."""
    if not worker_id:
        raise ValueError("worker_id must be non-empty")
    return workers_prefix(cluster) + worker_id.encode()


def worker_id_of(prefix: bytes, key: bytes) -> str:
    """The worker id of ``key`` under ``prefix`` (as ``workers_prefix`` made it)."""
    return key[len(prefix) :].decode(errors="replace")


def adapters_prefix(cluster: str, model: str) -> bytes:
    """The prefix of the runtime LoRA adapters' keys of ``model`` in ``cluster``;
    ``ValueError`` for an empty model (or cluster name as ``workers_prefix``)."""
    if not model:
        raise ValueError("model must be non-empty")
    return f"{_cluster_root(cluster)}/adapters/{quote(model, safe='')}/".encode()


def adapter_key(cluster: str, model: str, name: str) -> bytes:
    """The key of one runtime LoRA adapter of ``model``; ``ValueError`` for an empty name."""
    if not name:
        raise ValueError("the adapter's name must be non-empty")
    return adapters_prefix(cluster, model) + quote(name, safe="").encode()


def adapter_name_of(prefix: bytes, key: bytes) -> str:
    """The adapter's name of ``key`` under ``prefix`` (as ``adapters_prefix`` made it)."""
    return unquote(key[len(prefix) :].decode(errors="replace"))


def response_key(cluster: str, response_id: str) -> bytes:
    """The key of one stored Responses API response (``discovery/etcd_response_store.py``);
    ``ValueError`` for an empty id."""
    if not response_id:
        raise ValueError("the response id must be non-empty")
    return f"{_cluster_root(cluster)}/responses/{quote(response_id, safe='')}".encode()
