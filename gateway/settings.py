"""The gateway's flags, declared once (``common/settings.py``): ``splitserve gateway``'s parser
is generated from ``GatewaySettings``, and ``splitserve up`` starts gateways from the same
object (``settings_argv``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from splitserve.common.api_keys import ApiKeySettings
from splitserve.common.env_flags import env_name
from splitserve.common.settings import default_group, setting
from splitserve.common.tracing import TracingSettings
from splitserve.discovery.flags import MembershipSettings
from splitserve.gateway.defaults import (
    CLIENT_STALL_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    STORED_RESPONSES_MEMORY_BYTES,
    STORED_RESPONSES_TTL_S,
)
from splitserve.proto.streams_server import RELAYS
from splitserve.proto.tls import TlsSettings

DEFAULT_COORDINATOR = "127.0.0.1:50051"


@dataclass(frozen=True)
class ResponseStoreSettings:
    """Where the Responses API's stored responses live (``gateway/stored_responses.py``)."""

    TITLE: ClassVar[str] = "stored responses (the Responses API)"

    response_store: str = setting(
        "memory",
        "where the Responses API's stored responses live (previous_response_id, GET "
        "/v1/responses/{id}): 'memory' (this process), 'sqlite:PATH' (a file the gateway "
        "processes of a machine share), 'etcd' (every gateway of the cluster: --etcd-endpoints "
        "and --cluster-name) or 'none' (nothing stored)",
    )
    response_store_ttl: float = setting(STORED_RESPONSES_TTL_S, "seconds a stored response is kept")
    response_store_bytes: int = setting(
        STORED_RESPONSES_MEMORY_BYTES,
        "with --response-store memory: at most this many bytes, the least recently used "
        "dropped first",
    )


@dataclass(frozen=True)
class GatewaySettings:
    """Every flag of ``splitserve gateway`` (``main.py``)."""

    host: str = setting("127.0.0.1", "address the HTTP server binds")
    port: int = setting(8000, "HTTP port; 0 picks a free one")
    reuse_port: bool = setting(
        False,
        "share --port with other gateway processes (SO_REUSEPORT: the kernel spreads "
        "connections over them); this one's own /metrics is then also on a port of its own, "
        "printed at start",
    )
    coordinator: tuple[str, ...] = setting(
        (),
        "a model's coordinators: a gRPC address; several as ip:port,ip:port (or a DNS name "
        "resolving to several, dns:///name:port): calls are balanced over them and a stream "
        "whose coordinator dies continues through another. Give the flag once per model: "
        "each request goes to the coordinators of the model it names "
        f"(env {env_name('--coordinator')}, models separated by ';'; default "
        f"{DEFAULT_COORDINATOR})",
        env=False,  # its twin separates models by ';' (``main.py:coordinator_targets``)
    )
    served_model_name: str = setting(
        "",
        "comma-separated model names clients may use, with a single --coordinator only "
        "(default: the names the coordinators serve under, their --served-model-name)",
    )
    request_timeout: float = setting(3600.0, "deadline of each request's gRPC call, seconds")
    log_level: str = setting("warning", "uvicorn log level (info logs every request)")
    drain_timeout: float = setting(30.0, "on SIGTERM, seconds open streams may take to finish")
    max_body_bytes: int = setting(DEFAULT_MAX_BODY_BYTES, "larger request bodies get 413")
    relay: str = setting(
        "multiplexed",
        "how streams reach the coordinator: 'multiplexed' (many streams' tokens per gRPC "
        "message on shared GenerateStreams calls) or 'per-stream' (a Generate call each)",
        choices=RELAYS,
    )
    client_stall_timeout: float = setting(
        CLIENT_STALL_TIMEOUT_S,
        "an SSE client that reads nothing this many seconds loses its stream (and request)",
    )
    cpu_affinity: str | None = setting(None, "pin the process to these cores, e.g. '0' or '0-3'")
    tls: TlsSettings = default_group(TlsSettings)
    api_keys: ApiKeySettings = default_group(ApiKeySettings)
    health_needs_key: bool = setting(
        False, "with API keys, /health and /metrics need a key too (default: open, for probes)"
    )
    tracing: TracingSettings = default_group(TracingSettings)
    responses: ResponseStoreSettings = default_group(ResponseStoreSettings)
    etcd: MembershipSettings = default_group(MembershipSettings)
    """Reached only by ``--response-store etcd``."""
