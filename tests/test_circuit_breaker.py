"""The per-worker circuit breaker (torch-free): opens after consecutive failed calls, backs
off doubling, half-opens, closes on success; one incident counts once; heartbeats do not
reset it, and routing skips a worker whose breaker is open."""

from __future__ import annotations

from splitserve.common.load import EngineLoad
from splitserve.common.membership import Role
from splitserve.coordinator.circuit_breaker import BreakerState, CircuitBreaker
from splitserve.coordinator.registry import WorkerRecord, WorkerRegistry


def test_opens_after_consecutive_failures_backs_off_and_closes_on_success() -> None:
    breaker = CircuitBreaker(threshold=3, base_s=2.0, max_s=5.0)
    for now in (0.0, 1.0):
        breaker.record_failure(now)
        assert breaker.allows(now) and breaker.state(now) is BreakerState.CLOSED
    breaker.record_failure(2.0)
    assert not breaker.allows(3.9) and breaker.state(3.9) is BreakerState.OPEN
    assert breaker.allows(4.0) and breaker.state(4.0) is BreakerState.HALF_OPEN
    breaker.record_failure(4.0)  # the probe failed: open for twice as long
    assert not breaker.allows(7.9) and breaker.allows(8.0)
    breaker.record_failure(8.0)  # 8 s would exceed max_s: 5 s
    assert not breaker.allows(12.9) and breaker.allows(13.0)
    breaker.record_success()
    assert breaker.allows(13.0) and breaker.state(13.0) is BreakerState.CLOSED


def test_failures_of_one_incident_count_once() -> None:
    breaker = CircuitBreaker(threshold=3, incident_s=0.5)
    for now in (0.0, 0.1, 0.2, 0.3, 0.4):  # a worker died with five requests on it
        breaker.record_failure(now)
    assert breaker.failures == 1 and breaker.allows(0.4)


def test_routing_skips_an_open_breaker_whatever_the_heartbeats_say() -> None:
    registry = WorkerRegistry(expiry_s=100.0)
    registry.register(WorkerRecord("d", Role.DECODE, "d:1", "h", 16, "float32", 100, 4096))
    load = EngineLoad(num_total_blocks=100)
    for now in (10.0, 11.0, 12.0):  # three failed calls, a heartbeat after each
        registry.mark_failed("d", now=now)
        assert registry.heartbeat("d", load)
    assert registry.workers(Role.DECODE, now=12.5) == []
    assert [w.worker_id for w in registry.workers(Role.DECODE, now=14.0)] == ["d"]  # half-open
    registry.mark_succeeded("d")
    assert [w.worker_id for w in registry.workers(Role.DECODE, now=14.0)] == ["d"]
    assert registry.get("d").breaker.state(14.0) is BreakerState.CLOSED  # type: ignore[union-attr]
