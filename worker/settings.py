"""A worker process's flags, declared once (``common/settings.py``): the parsers of
``splitserve prefill|decode|worker`` are generated from ``WorkerSettings``
(``process.py:add_worker_args``), and ``splitserve up`` starts workers from the same object.
Torch-free, so ``up`` builds worker commands without loading torch."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.common.settings import default_group, setting
from splitserve.common.tracing import TracingSettings
from splitserve.discovery.flags import MembershipSettings
from splitserve.engine.cli_args import EngineSettings
from splitserve.proto.cluster_access import ClusterAccessSettings
from splitserve.proto.server import ReflectionSettings
from splitserve.transfer.ucx_settings import PROGRESS_MODES
from splitserve.worker.stall_watch import DEFAULT_STALL_TIMEOUT_S
from splitserve.worker.transfer_settings import DEFAULT_PULL_MIN_BLOCKS


@dataclass(frozen=True)
class WorkerSettings:
    """Every flag of a worker process (``splitserve prefill|decode|worker``), declared once
    (``common/settings.py``): their parsers are generated from it, and ``splitserve up``
    starts workers from the same object. The engine's are the ``engine`` group."""

    host: str = setting("127.0.0.1", "address the gRPC server binds")
    port: int = setting(0, "gRPC port; 0 picks a free one (printed when ready)")
    advertise_host: str | None = setting(None, "host the coordinator and peers should dial")
    coordinator: str | None = setting(
        None,
        "the coordinators' internal host:port (their --internal-port), comma-separated: the "
        "worker registers with each and takes work from all",
    )
    worker_id: str | None = setting(None, "unique worker name (default: role-host-pid)")
    cpu_affinity: str | None = setting(None, "pin the process to these cores, e.g. '0' or '0-3'")
    busy_file: str | None = setting(
        None,
        "publish in this file (node-local, e.g. under /dev/shm) whether this worker's engine "
        "has work, so a co-located worker may borrow its cores while it idles",
    )
    borrow_cores: str | None = setting(
        None,
        "cores of a co-located worker this one may also run its steps on while that worker "
        "idles (with --borrow-while-idle; needs --cpu-affinity)",
    )
    borrow_while_idle: str | None = setting(
        None, "the --busy-file of the worker owning --borrow-cores"
    )
    ucx_tls: str | None = setting(None, "UCX transports (UCX_TLS), e.g. 'sm,self' or 'tcp'")
    ucx_error_handling: bool = setting(False, "UCX peer-failure detection (forces TCP on one host)")
    ucx_progress: str | None = setting(
        None,
        "how ucxx drives UCX: 'thread' (its default: a thread sleeping between requests) or "
        "'thread-polling' (that thread spins on a core of its own)",
        choices=PROGRESS_MODES,
    )
    transfer_timeout: float = setting(30.0, "seconds a KV transfer may take before it fails")
    pull_cached_kv_min_blocks: int = setting(
        DEFAULT_PULL_MIN_BLOCKS,
        "a prefill worker receives a prompt's leading KV from the decode worker that holds "
        "it (a conversation's history) when it would get at least this many blocks so, and "
        "computes only the rest; 0: never",
    )
    kv_message_bytes: int | None = setting(
        None,
        "smallest KV message this worker asks its senders for: consecutive layers are grouped "
        "into messages of at least this many bytes (0: one layer a message; default by the "
        "cache's device: 1 MiB on the CPU, 16 MiB on a GPU)",
    )
    drain_timeout: float = setting(
        30.0,
        "on SIGTERM, seconds running requests may take to finish before they are handed over",
    )
    stall_timeout: float = setting(
        DEFAULT_STALL_TIMEOUT_S,
        "seconds one engine step may run before the worker reports itself not ready",
    )
    lora_dir: str | None = setting(
        None,
        "LoRA adapters may be loaded and unloaded while the worker serves (the gateway's "
        "/v1/load_lora_adapter), read only from folders under this one; unset: never",
    )
    metrics_port: int = setting(0, "Prometheus /metrics port (0: any free port, -1: off)")
    host_workers: int = setting(
        1,
        "workers this process hosts, each with its own port and membership record "
        "(<worker id>-<i>; --port and --metrics-port count up from the given ones); above 1 "
        "only with --engine sim, for scale tests",
    )
    reflection: ReflectionSettings = default_group(ReflectionSettings)
    access: ClusterAccessSettings = default_group(ClusterAccessSettings)
    membership: MembershipSettings = default_group(MembershipSettings)
    tracing: TracingSettings = default_group(TracingSettings)
    engine: EngineSettings = default_group(EngineSettings)
