"""The clients' retries are gRPC's own: ``channel_options(policy)`` puts a ``RetryPolicy`` into
the channel's service config, and gRPC (C-core) retries every ``splitserve.v1.Coordinator``
call on that channel. The clients make one gRPC call per method call and never loop, except to
continue a stream whose coordinator died after it delivered tokens (``stream``: another call,
to another coordinator of the channel, with ``continue_after``). With several coordinators in
the target the channel balances calls round robin over those that answer and report SERVING
(client-side health checks of ``splitserve.v1.Coordinator``, only then: a lone coordinator
answers for itself, e.g. "no decode worker is registered yet"; with ``--health-needs-key`` on
the coordinators every one would look unhealthy: give clients one address there).

How gRPC's ``retryPolicy`` gives the clients' retry contract (each point checked against a real
server in ``tests/test_client.py``):

- retried codes: UNAVAILABLE, plus RESOURCE_EXHAUSTED when ``policy.retry_overloaded``; any
  other code (INVALID_ARGUMENT, DEADLINE_EXCEEDED, ...) is final at once;
- at most ``policy.max_attempts`` attempts (gRPC takes 2 to 5; 1 gets no ``retryPolicy``);
- streams: gRPC retries only until the call commits, at the first response message or
  response headers, so never after a chunk was delivered. The coordinator sends its headers
  with its first message (and an in-stream ``Error`` only after one), so the two coincide;
- waits: before attempt ``n + 1``, ``min(max_backoff, initial_backoff * multiplier**(n - 1))``
  times a random factor in ``[0.8, 1.2]``, or exactly the server's ``grpc-retry-pushback-ms``
  (``proto.status.abort_with`` sends it with ``retry-after-ms``). The factor is gRPC's and
  fixed: grpcio's C-core (1.85, measured) draws it from [0.8, 1.2] after the cap, though the
  retry design (gRFC A6) says a uniform wait in ``[0, backoff]``; ``policy.jitter`` has no
  counterpart in the service config and is ignored;
- deadline: a call's timeout covers all its attempts and waits. A backoff wait that outlasts
  it ends the call with DEADLINE_EXCEEDED at the deadline (the clients' own loop raised the last
  error at once). A server hint that outlasts it still gives RESOURCE_EXHAUSTED at once with
  ``retry_after_s``: ``abort_with`` then sends pushback -1, gRPC's "do not retry";
- request size: gRPC replays a buffered copy of the request, and a request over its default
  256 KiB buffer commits the call at once (no retries); the buffer is raised to the message
  size limit so long prompts are retried like short ones.
"""

from __future__ import annotations

import json
import time
from types import EllipsisType

from splitserve.client.errors import RetryPolicy
from splitserve.client.wire import COORDINATOR_SERVICE
from splitserve.proto.server import CHANNEL_OPTIONS, MAX_MESSAGE_BYTES

ChannelOptions = tuple[tuple[str, str | int], ...]

_MIN_BACKOFF_MS = 1
"""gRPC durations have millisecond resolution and a backoff must be > 0."""


def service_config(policy: RetryPolicy, health_checked: bool = False) -> dict[str, object]:
    """The service config (as a JSON-able dict) that retries Coordinator calls by ``policy``;
    without a ``retryPolicy`` when ``policy.max_attempts == 1``. ``health_checked`` (a target
    of several coordinators): gRPC checks each one's health itself and leaves out those not
    SERVING (just restarted with no decode worker yet, draining)."""
    method_config: dict[str, object] = {"name": [{"service": COORDINATOR_SERVICE}]}
    if policy.max_attempts > 1:
        codes = ["UNAVAILABLE"] + (["RESOURCE_EXHAUSTED"] if policy.retry_overloaded else [])
        method_config["retryPolicy"] = {
            "maxAttempts": policy.max_attempts,
            "initialBackoff": _duration(policy.initial_backoff_s),
            "maxBackoff": _duration(policy.max_backoff_s),
            "backoffMultiplier": policy.multiplier,
            "retryableStatusCodes": codes,
        }
    config: dict[str, object] = {
        "methodConfig": [method_config],
        "loadBalancingConfig": [{"round_robin": {}}],
    }
    if health_checked:
        config["healthCheckConfig"] = {"serviceName": COORDINATOR_SERVICE}
    return config


def channel_options(policy: RetryPolicy, health_checked: bool = False) -> ChannelOptions:
    """The shared channel options plus gRPC retries by ``policy`` (and ``health_checked``, see
    ``service_config``); give them to a channel you pass to ``Client`` / ``AsyncClient`` (a
    passed-in channel retries as it was built)."""
    return (
        *CHANNEL_OPTIONS,
        ("grpc.enable_retries", 1),
        ("grpc.per_rpc_retry_buffer_size", MAX_MESSAGE_BYTES),
        ("grpc.service_config", json.dumps(service_config(policy, health_checked))),
        ("grpc.service_config_disable_resolution", 1),  # DNS may not replace the policy
    )


def _duration(seconds: float) -> str:
    """A protobuf JSON duration, rounded to gRPC's millisecond resolution (at least 1 ms)."""
    milliseconds = max(_MIN_BACKOFF_MS, round(seconds * 1000))
    return f"{milliseconds / 1000:.3f}s"


class Deadline:
    """The end of a call, ``timeout_s`` from now (None: no deadline)."""

    def __init__(self, timeout_s: float | None) -> None:
        self._end = None if timeout_s is None else time.monotonic() + timeout_s

    def remaining(self) -> float | None:
        """Seconds left (never negative), None without a deadline."""
        if self._end is None:
            return None
        return max(0.0, self._end - time.monotonic())


def resolve_timeout(override: float | None | EllipsisType, default: float | None) -> float | None:
    """A call's timeout: its own ``override`` unless that is ``...`` (the client's default)."""
    return default if override is ... else override
