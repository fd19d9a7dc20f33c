"""``splitserve frontend``'s flags: every coordinator flag (``coordinator/settings.py``) and
the few the in-process gateway adds (``HttpSettings``, and the gateway's own
``ResponseStoreSettings``). The gateway's other settings are the coordinator's (host, TLS,
API keys, drain and stall timeouts, tracing, etcd): one process, one answer to each
(``gateway_settings``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from splitserve.common.settings import default_group, setting
from splitserve.coordinator.settings import CoordinatorSettings
from splitserve.gateway.defaults import DEFAULT_MAX_BODY_BYTES
from splitserve.gateway.settings import GatewaySettings, ResponseStoreSettings


@dataclass(frozen=True)
class HttpSettings:
    """The in-process gateway's own flags."""

    TITLE: ClassVar[str] = "OpenAI-compatible HTTP (the gateway in this process)"

    http_port: int = setting(8000, "HTTP port of the OpenAI-compatible API; 0 picks a free one")
    request_timeout: float = setting(3600.0, "deadline of each HTTP request's stream, seconds")
    max_body_bytes: int = setting(DEFAULT_MAX_BODY_BYTES, "larger request bodies get 413")
    http_log_level: str = setting("warning", "uvicorn log level (info logs every request)")


@dataclass(frozen=True)
class FrontendSettings:
    """Every flag of ``splitserve frontend`` (``main.py``)."""

    coordinator: CoordinatorSettings = default_group(CoordinatorSettings)
    http: HttpSettings = default_group(HttpSettings)
    responses: ResponseStoreSettings = default_group(ResponseStoreSettings)


def gateway_settings(settings: FrontendSettings, coordinator_address: str) -> GatewaySettings:
    """The in-process gateway's settings: ``settings.http``'s, the rest the coordinator's;
    ``coordinator_address``: where its calls other than streams (model info, tokenize) dial
    the coordinator. Not pinned again (the process already is)."""
    own, http = settings.coordinator, settings.http
    return GatewaySettings(
        host=own.host,
        port=http.http_port,
        coordinator=(coordinator_address,),
        request_timeout=http.request_timeout,
        log_level=http.http_log_level,
        drain_timeout=own.drain_timeout,
        max_body_bytes=http.max_body_bytes,
        client_stall_timeout=own.client_stall_timeout,
        tls=own.access.tls,
        api_keys=own.api_keys,
        health_needs_key=own.health_needs_key,
        tracing=own.tracing,
        responses=settings.responses,
        etcd=own.membership,
    )
