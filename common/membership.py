"""What a worker publishes about itself to the coordinators (torch-free).

A worker announces a ``WorkerInfo`` when it registers and its ``EngineLoad`` with every
heartbeat; coordinators keep both in their registry and route on them. ``proto/convert.py``
holds the converter pair, ``proto/membership_client.py`` the calls.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from splitserve.common.adapter_id import AdapterId
from splitserve.common.kv_layout import KvLayout
from splitserve.common.load import EngineLoad


class Role(enum.Enum):
    """Which phase of a request a worker computes."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's identity, place and capacity; fixed for the life of its process."""

    worker_id: str
    role: Role
    address: str
    """host:port of its gRPC server, as the coordinators and peers dial it."""
    layout: KvLayout
    """Its KV cache's layout; KV moves only between workers with equal ``compat_hash``."""
    num_blocks: int
    """KV blocks of ``layout.block_size`` tokens it holds."""
    max_model_len: int
    """The longest context (prompt + output) it serves."""
    model: str = ""
    """The checkpoint it serves, by name (``common/model_files.py:model_name_of``); "" for a
    worker that did not say (taken as the coordinator's own)."""
    pulls_cached_kv_min_blocks: int = 0
    """A prefill worker that pulls a decode worker's cached prefix of a prompt (the reverse
    transfer, ``transfer/reservation.py:CachedKvPull``) when that worker holds at least this
    many more of its leading blocks; 0: it computes whatever its own prefix cache lacks."""
    adapters: tuple[AdapterId, ...] = ()
    """The LoRA adapters it serves (``--lora-modules``)."""


@dataclass(frozen=True)
class MemberStatus:
    """One registered worker as a coordinator sees it now (``ListWorkers``)."""

    info: WorkerInfo
    load: EngineLoad
    """Its latest reported load."""
    ready: bool
    """It reported progress (its engine is not stalled)."""
    ms_since_heartbeat: int
    """Age of ``load``."""
    routable: bool
    """The coordinator routes requests to it now (dialled back, healthy, circuit closed)."""


def hosted_worker_ids(worker_id: str, num_hosted: int) -> list[str]:
    """The worker ids of a process hosting ``num_hosted`` workers (``--host-workers``):
    ``worker_id`` itself for one, ``<worker_id>-<i>`` for each of several."""
    if num_hosted == 1:
        return [worker_id]
    return [f"{worker_id}-{index}" for index in range(num_hosted)]


def member_id(worker_id: str, role_name: str, num_roles: int) -> str:
    """The id a worker's role registers under: the worker's id, or for a worker of several
    roles that id with the role's name appended (each role is its own member, at the same
    address). ``splitserve up`` derives the ids it waits for with it."""
    return worker_id if num_roles == 1 else f"{worker_id}-{role_name}"
