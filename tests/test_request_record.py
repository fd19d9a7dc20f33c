"""The coordinator's request record: what the edge parses into a ``RequestAsk`` and what a
``RequestRecord`` answers for every later step (``coordinator/request_record.py``)."""

from __future__ import annotations

import math

import pytest

from splitserve.common.errors import InvalidRequestError
from splitserve.common.sampling_params import SamplingParams
from splitserve.coordinator.placement import Slo
from splitserve.coordinator.servicer import ask_from_proto
from splitserve.proto.splitserve.v1 import common_pb2, coordinator_pb2
from tests.request_records import record


def _request(**targets: float) -> coordinator_pb2.GenerateRequest:
    return coordinator_pb2.GenerateRequest(
        text="Hello",
        request_id="mine",
        priority=2,
        session_id="s",
        sampling=common_pb2.SamplingParams(max_tokens=5),
        latency_targets=coordinator_pb2.LatencyTargets(**targets),
    )


def test_the_edge_parses_every_field_of_a_request_once() -> None:
    ask = ask_from_proto(_request(ttft_ms=500, max_queue_wait_ms=250))
    assert (ask.prompt, ask.request_id, ask.priority, ask.session_id) == ("Hello", "mine", 2, "s")
    assert ask.targets.ttft_ms == 500 and ask.targets.tpot_ms is None
    assert ask.max_queue_wait_s == pytest.approx(0.25)
    assert ask.sampling.max_tokens == 5
    assert ask_from_proto(_request()).max_queue_wait_s is None  # 0: the coordinator's
    for bad in (-1.0, math.inf):
        with pytest.raises(InvalidRequestError) as refused:
            ask_from_proto(_request(max_queue_wait_ms=bad))
        assert refused.value.param == "latency_targets.max_queue_wait_ms"


def test_a_record_answers_what_every_step_reads_of_it() -> None:
    request = record(
        range(30),
        10,
        slo=Slo(ttft_s=2.0, tpot_s=0.05),
        arrived_at=100.0,
        params=SamplingParams(stop=("\n",)),
    )
    assert request.tokens_left(4) == 6  # a resume after 4 streamed tokens
    assert request.ttft_deadline == 102.0
    demand = request.kv_demand(16)
    assert (demand.num_tokens, demand.num_prompt_tokens, demand.max_tokens) == (48, 30, 10)
    assert request.context_after([7, 8]) == [*range(30), 7, 8]
    assert request.params.stop == ("\n",) and request.params.max_tokens == 10
    with pytest.raises(AttributeError):  # frozen
        request.priority = 3  # type: ignore[misc]
