"""The entry points' request histograms (``common/metrics.py:LoopHistogram``): the series a
scrape reads are exactly prometheus_client's ``Histogram``'s for the same observations, a
bound included in its own bucket, one series per label set."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from splitserve.common.metrics import (
    INTER_TOKEN_LATENCY_BUCKETS,
    LoopHistogram,
    RequestMetricFamilies,
    request_token_buckets,
)

OBSERVED = (0.0, 0.001, 0.01, 0.0100001, 0.05, 0.075, 0.3, 5.0, 80.0, 100.0)
"""Below the first bound, on bounds, just past one, and above the last."""


def test_a_scrape_reads_what_prometheus_clients_histogram_exposes() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    labels = ["model_name", "role"]
    reference = Histogram(
        "splitserve_x_seconds", "X.", labels, registry=theirs, buckets=INTER_TOKEN_LATENCY_BUCKETS
    )
    loop = LoopHistogram("splitserve_x_seconds", "X.", labels, INTER_TOKEN_LATENCY_BUCKETS, ours)
    for value in OBSERVED:
        reference.labels("m", "gateway").observe(value)
        loop.labels("m", "gateway").observe(value)
    reference.labels("other", "gateway").observe(0.02)
    loop.labels("other", "gateway").observe(0.02)
    assert generate_latest(ours) == generate_latest(theirs)
    assert ours.get_sample_value(
        "splitserve_x_seconds_bucket", {"model_name": "m", "role": "gateway", "le": "0.01"}
    ) == 3  # fmt: skip


def test_large_bounds_are_labelled_as_prometheus_client_labels_them() -> None:
    """Token-count buckets of a long context reach 1e6 and past, which Prometheus writes in
    exponent form (``le="1e+06"``)."""
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    buckets = request_token_buckets(5_000_000)
    reference = Histogram("splitserve_t", "T.", ["role"], registry=theirs, buckets=buckets)
    loop = LoopHistogram("splitserve_t", "T.", ["role"], buckets, ours)
    for value in (3, 999_999, 2_000_000, 10_000_000):
        reference.labels("coordinator").observe(value)
        loop.labels("coordinator").observe(value)
    assert generate_latest(ours) == generate_latest(theirs)


def test_request_timers_feed_the_histograms_of_their_model() -> None:
    registry = CollectorRegistry()
    metrics = RequestMetricFamilies(registry).for_model("m", "coordinator")
    timer = metrics.start()
    timer.tokens(1)
    timer.tokens(3)
    timer.finish("stop", prompt_tokens=5, generation_tokens=4)
    labels = {"model_name": "m", "role": "coordinator"}
    sample = registry.get_sample_value
    assert sample("splitserve_time_to_first_token_seconds_count", labels) == 1
    assert sample("splitserve_inter_token_latency_seconds_count", labels) == 3
    assert sample("splitserve_request_prompt_tokens_sum", labels) == 5
    assert sample("splitserve_request_success_total", {**labels, "finished_reason": "stop"}) == 1


def test_every_token_after_the_first_is_one_inter_token_observation() -> None:
    """However the tokens are chunked, ``n`` tokens give ``n - 1`` inter-token observations
    (a first chunk of two tokens once gave one fewer: a gateway test's count was off by one
    whenever the first token and the next reached it in one message)."""
    registry = CollectorRegistry()
    metrics = RequestMetricFamilies(registry).for_model("m", "gateway")
    labels = {"model_name": "m", "role": "gateway"}
    for chunks in ((2, 1, 1, 1), (1, 1, 1, 1, 1), (3, 2), (5,)):
        before = registry.get_sample_value("splitserve_inter_token_latency_seconds_count", labels)
        timer = metrics.start()
        for count in chunks:
            timer.tokens(count)
        timer.finish("length", 10, sum(chunks))
        after = registry.get_sample_value("splitserve_inter_token_latency_seconds_count", labels)
        assert after - (before or 0) == sum(chunks) - 1, chunks
