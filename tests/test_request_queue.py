"""The admission queue's policy (``coordinator/request_queue.py``) on plain objects: higher
priority first, then weighted fair queuing across tenants, then arrival; removal from
anywhere keeps the rest in order."""

from __future__ import annotations

import pytest

from splitserve.coordinator.request_queue import AdmissionOrder, FairRequestQueue

COST = 32


def enqueue(queue: FairRequestQueue[str], name: str, tenant: str, **ask: float) -> None:
    """A request of ``tenant`` that waits (``weight``, ``priority`` as asked)."""
    weight = ask.get("weight", 1.0)
    ticket = queue.ticket(tenant, weight, COST, int(ask.get("priority", 0)))
    queue.commit(ticket)
    queue.add(ticket, name)


def drain(queue: FairRequestQueue[str]) -> list[str]:
    return [queue.pop() for _ in range(len(queue))]


def test_higher_priority_comes_first_then_arrival_within_a_tenant() -> None:
    queue: FairRequestQueue[str] = FairRequestQueue()
    enqueue(queue, "low-1", "t")
    enqueue(queue, "urgent", "t", priority=5)
    enqueue(queue, "low-2", "t")
    enqueue(queue, "lowest", "t", priority=-1)
    assert queue.peek() == "urgent" and len(queue) == 4
    assert drain(queue) == ["urgent", "low-1", "low-2", "lowest"]
    with pytest.raises(IndexError):
        queue.peek()


def test_a_flooding_tenant_queues_behind_its_own_requests() -> None:
    queue: FairRequestQueue[str] = FairRequestQueue()
    for i in range(4):
        enqueue(queue, f"flood-{i}", "flood")
    enqueue(queue, "polite", "polite")  # arrives last, starts at the virtual time
    assert drain(queue)[:2] == ["flood-0", "polite"]


def test_weights_share_the_queue_in_proportion() -> None:
    queue: FairRequestQueue[str] = FairRequestQueue()
    for i in range(8):
        enqueue(queue, f"light-{i}", "light")
        enqueue(queue, f"heavy-{i}", "heavy", weight=3.0)
    first = drain(queue)[:8]
    assert sum(name.startswith("heavy") for name in first) == 6, first  # 3 : 1
    assert "light-0" in first


def test_the_virtual_time_moves_with_admissions_and_forgets_past_tags() -> None:
    queue: FairRequestQueue[str] = FairRequestQueue()
    early = queue.ticket("busy", 1.0, COST, 0)
    queue.commit(early)
    queue.started(early)
    late = queue.ticket("busy", 1.0, COST, 0)  # behind its tenant's previous finish tag
    assert late.start_tag == early.order.finish_tag == COST
    queue.commit(late)
    queue.started(late)
    newcomer = queue.ticket("new", 1.0, COST, 0)  # starts at the virtual time, not at 0
    assert newcomer.start_tag == late.start_tag


def test_a_ticket_not_committed_moves_no_tenants_tags() -> None:
    queue: FairRequestQueue[str] = FairRequestQueue()
    refused = queue.ticket("t", 1.0, COST, 0)
    again = queue.ticket("t", 1.0, COST, 0)
    assert again.start_tag == refused.start_tag and again.order > refused.order


def test_removal_anywhere_keeps_the_rest_in_order() -> None:
    queue: FairRequestQueue[str] = FairRequestQueue()
    for name in ("a", "b", "c", "d"):
        enqueue(queue, name, "t")
    queue.remove("b")
    queue.remove("d")
    with pytest.raises(ValueError):
        queue.remove("b")
    assert list(queue) == ["a", "c"] and len(queue) == 2
    assert drain(queue) == ["a", "c"] and not queue


def test_ahead_of_lists_those_before_an_order() -> None:
    queue: FairRequestQueue[str] = FairRequestQueue()
    for name in ("a", "b", "c"):
        enqueue(queue, name, name)  # three tenants: equal finish tags, arrival decides
    assert queue.ahead_of(None) == ["a", "b", "c"]
    assert queue.ahead_of(AdmissionOrder(0, float(COST), 2)) == ["a", "b"]
    assert queue.ahead_of((0, -1.0, -1)) == []  # a plain tuple compares the same way
    assert queue.ahead_of((-1, 1e9, 99)) == []  # a higher priority goes before them all
