"""Tenants in admission (``coordinator/tenants.py`` + ``coordinator/admission.py``) on plain
objects: the tenants file, the token bucket, and what each tenant gets when they compete:
weighted fair order in the queue, priorities, in-flight and tokens-per-minute limits with
computed retry hints, and what a tenant may never ask."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from splitserve.common.errors import InvalidRequestError, OverloadedError
from splitserve.coordinator.admission import (
    AdmissionConfig,
    AdmissionOutcome,
    KvAdmission,
    KvDemand,
)
from splitserve.coordinator.tenants import TenantLimits, TenantPolicy, TokenBucket
from tests.request_records import admit

T = TypeVar("T")


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def run(scenario: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(scenario, timeout=10))


def demand(prompt: int = 16, max_tokens: int = 16) -> KvDemand:
    return KvDemand.of(prompt, max_tokens, 16)


def gate(policy: TenantPolicy, capacity: int = 64, clock: Clock | None = None) -> KvAdmission:
    return KvAdmission(
        AdmissionConfig(prior_tpot_s=0.05, prior_ttft_s=0.0),
        lambda: capacity,
        clock or Clock(),
        policy,
    )


def test_the_tenants_file_overrides_the_flags_per_tenant(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(
        "[default]\nmax_inflight = 8\n\n"
        "[tenants.acme]\nweight = 4.0\nmax_priority = 10\ntokens_per_minute = 1000\n"
    )
    policy = TenantPolicy.from_toml(path, TenantLimits(tokens_per_minute=500))
    assert policy.limits("anyone") == TenantLimits(max_inflight=8, tokens_per_minute=500)
    assert policy.limits("acme") == TenantLimits(
        max_inflight=8, tokens_per_minute=1000, weight=4.0, max_priority=10
    )
    path.write_text("[tenants.acme]\nweight = 0\n")
    with pytest.raises(ValueError, match=r"\[tenants.acme\].*weight"):
        TenantPolicy.from_toml(path)
    path.write_text("[default]\nburst = 3\n")
    with pytest.raises(ValueError, match=r"\[default\]: unknown keys \['burst'\]"):
        TenantPolicy.from_toml(path)


def test_a_token_bucket_refills_at_its_rate_up_to_one_minute() -> None:
    clock = Clock()
    bucket = TokenBucket(600, clock)  # 10 tokens per second
    assert bucket.wait_s(600) == 0
    bucket.take(600)
    assert bucket.wait_s(50) == pytest.approx(5.0)
    clock.now += 5
    assert bucket.wait_s(50) == 0
    clock.now += 3600
    assert bucket.wait_s(600) == 0 and bucket.wait_s(601) > 0  # capped at a minute's worth
    bucket.take(100)
    bucket.give_back(100)
    assert bucket.wait_s(600) == 0


def test_a_flooding_tenant_waits_behind_its_own_requests_not_in_front_of_others() -> None:
    admission = gate(TenantPolicy(TenantLimits()), capacity=64)

    async def scenario() -> list[str]:
        order: list[str] = []

        async def request(name: str, tenant: str) -> None:
            await admit(admission, name, demand(), tenant)
            order.append(name)

        await request("flood-0", "flood")
        await request("flood-1", "flood")  # 64 of 64
        tasks = [asyncio.create_task(request(f"flood-{i}", "flood")) for i in range(2, 8)]
        await asyncio.sleep(0)
        polite = asyncio.create_task(request("polite", "polite"))  # arrives last
        await asyncio.sleep(0)
        for name in ("flood-0", "flood-1", "flood-2", "polite", "flood-3", "flood-4"):
            admission.release(name)  # one at a time: each frees room for one
            await asyncio.sleep(0.01)
        admission.release("flood-5")
        admission.release("flood-6")
        await asyncio.wait_for(asyncio.gather(*tasks, polite), 1.0)
        return order

    order = run(scenario())
    # the flood's queued requests carry finish tags beyond the polite tenant's first one
    assert order.index("polite") == 2, order


def test_weights_share_the_queue_in_proportion() -> None:
    policy = TenantPolicy(overrides={"heavy": TenantLimits(weight=3.0)})
    admission = gate(policy, capacity=32)  # one request at a time

    async def scenario() -> list[str]:
        order: list[str] = []
        await admit(admission, "first", demand(), "someone-else")
        tasks = []
        for i in range(8):
            for tenant in ("light", "heavy"):
                name = f"{tenant}-{i}"

                async def request(name: str = name, tenant: str = tenant) -> None:
                    await admit(admission, name, demand(), tenant)
                    order.append(name)

                tasks.append(asyncio.create_task(request()))
        await asyncio.sleep(0)
        admission.release("first")
        for _ in range(8):
            await asyncio.sleep(0.01)
            admission.release(order[-1])
        return order

    order = run(scenario())[:8]
    assert sum(name.startswith("heavy") for name in order) == 6, order  # 3 : 1
    assert order.index("light-0") < order.index("heavy-3"), order  # light is not starved


def test_higher_priority_is_admitted_first_within_what_the_tenant_may_ask() -> None:
    policy = TenantPolicy(overrides={"ops": TenantLimits(max_priority=5)})
    admission = gate(policy, capacity=32)

    async def scenario() -> None:
        await admit(admission, "running", demand(), "ops")
        low = asyncio.create_task(admit(admission, "low", demand(), "user"))
        await asyncio.sleep(0)
        urgent = asyncio.create_task(admit(admission, "urgent", demand(), "ops", priority=5))
        await asyncio.sleep(0)
        admission.release("running")
        await asyncio.wait_for(urgent, 1.0)
        assert not low.done()
        admission.release("urgent")
        await asyncio.wait_for(low, 1.0)
        with pytest.raises(InvalidRequestError, match="priority") as error:
            await admit(admission, "bold", demand(), "user", priority=1)
        assert error.value.param == "priority"
        admission.release("low")
        await admit(admission, "humble", demand(), "user", priority=-3)  # lower is always fine

    run(scenario())


def test_a_late_waiter_yields_only_to_waiters_of_its_priority_or_lower() -> None:
    """Lateness reorders within a priority, never across: a late urgent request still goes
    before an on-time ordinary one, and a late ordinary one after it."""
    policy = TenantPolicy(overrides={"ops": TenantLimits(max_priority=5)})
    clock = Clock()
    admission = gate(policy, capacity=32, clock=clock)

    async def scenario() -> None:
        await admit(admission, "running", demand(), "ops")
        urgent = asyncio.create_task(
            admit(admission, "urgent", demand(), "ops", 5, ttft_deadline=clock.now + 1)
        )
        old = asyncio.create_task(
            admit(admission, "old", demand(), "user", ttft_deadline=clock.now + 1)
        )
        await asyncio.sleep(0)
        clock.now += 2  # both are late now
        fresh = asyncio.create_task(
            admit(admission, "fresh", demand(), "user", ttft_deadline=clock.now + 2)
        )
        await asyncio.sleep(0)
        admission.release("running")
        await asyncio.wait_for(urgent, 1.0)  # late, but of a higher priority
        assert not old.done() and not fresh.done()
        admission.release("urgent")
        await asyncio.wait_for(fresh, 1.0)  # on time: before the late one of its priority
        assert not old.done()
        admission.release("fresh")
        await asyncio.wait_for(old, 1.0)

    run(scenario())


def test_the_in_flight_limit_refuses_with_the_tenants_next_end_as_hint() -> None:
    admission = gate(TenantPolicy(TenantLimits(max_inflight=2)), capacity=1000)
    outcomes: list[AdmissionOutcome] = []
    admission.outcome_listeners.append(outcomes.append)

    async def scenario() -> None:
        await admit(admission, "a", demand(16, 40), "t")  # ends in 40 x 0.05 = 2 s
        await admit(admission, "b", demand(16, 10), "t")  # ends in 0.5 s
        with pytest.raises(OverloadedError, match="2 requests in flight") as refused:
            await admit(admission, "c", demand(), "t")
        assert refused.value.retry_after_s == pytest.approx(0.5)
        await admit(admission, "other", demand(), "u")  # other tenants are not limited by it
        admission.release("b")
        await admit(admission, "c", demand(), "t")
        assert admission.refusals["tenant_inflight"] == 1

    run(scenario())
    # every decision reaches the listeners with its tenant (metrics per tenant, and the
    # retry hints' spread)
    assert [(o.tenant, o.refused) for o in outcomes] == [
        ("t", None), ("t", None), ("t", "tenant_inflight"), ("u", None), ("t", None)
    ]  # fmt: skip
    assert outcomes[2].retry_after_s == pytest.approx(0.5)
    assert all(o.retry_after_s is None for o in outcomes if o.refused is None)


def test_tokens_per_minute_refuse_with_the_refill_time_and_unused_output_comes_back() -> None:
    clock = Clock()
    admission = gate(TenantPolicy(TenantLimits(tokens_per_minute=600)), 1000, clock)

    async def scenario() -> None:
        await admit(admission, "a", demand(100, 400), "t")  # 500 of 600
        with pytest.raises(OverloadedError, match="per minute") as refused:
            await admit(admission, "b", demand(100, 100), "t")  # 200 > 100 left
        assert refused.value.retry_after_s == pytest.approx(10.0)  # 100 at 10 per second
        admission.progress("a", 100)
        admission.release("a")  # 300 of its 400 output tokens never came: back in the bucket
        await admit(admission, "b", demand(100, 100), "t")
        with pytest.raises(InvalidRequestError, match="per minute") as error:
            await admit(admission, "huge", demand(100, 600), "t")
        assert error.value.param == "max_tokens"

    run(scenario())
