"""Figures read from a process's Prometheus text exposition (``/metrics``).

``metric_total`` sums the samples of one name whose labels include the given ones, from text
``scrape`` fetched (one fetch serves several figures). A sample name is the full
one: a histogram's parts are ``<name>_sum``, ``<name>_count`` and ``<name>_bucket``, a
counter's value ``<name>_total``. Neither raises for a name that is absent: the total is 0.0,
as for a counter that has not moved yet.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families


def metric_total(text: str, name: str, labels: Mapping[str, str] | None = None) -> float:
    """The sum of every sample named ``name`` in ``text`` whose labels include ``labels``
    (each key with that value; other labels may differ); 0.0 where none matches."""
    wanted = dict(labels or {})
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in wanted.items())
    )


def scrape(url: str, timeout_s: float = 10.0) -> str:
    """The text served at a ``/metrics`` ``url`` (raises ``httpx.HTTPError`` when the scrape
    fails: a figure that could not be read is not 0). httpx is imported here, so
    ``metric_total`` serves where only the serving stack is installed (a GPU image)."""
    import httpx

    reply = httpx.get(url, timeout=timeout_s)
    reply.raise_for_status()
    return reply.text
