"""The engine's histograms, as a Prometheus scraper reads them."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from stepline.actors.metrics import Buckets


def scrape(registry: CollectorRegistry) -> dict[str, float]:
    text = generate_latest(registry).decode()
    return {
        s.name + "".join(f"{{{v}}}" for v in s.labels.values()): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_histogram_fed_in_batches_reads_as_prometheus_buckets() -> None:
    registry = CollectorRegistry()
    h = Buckets("stepline_gap_seconds", "Gaps", (0.01, 0.1, 1), registry)
    h.observe_many([0.005, 0.01, 0.05])  # a value on a bound counts in that bound's bucket
    h.observe_many([])
    h.observe(2.0)
    h.observe_many((0.1, 0.5))
    got = scrape(registry)
    assert got["stepline_gap_seconds_bucket{0.01}"] == 2
    assert got["stepline_gap_seconds_bucket{0.1}"] == 4
    assert got["stepline_gap_seconds_bucket{1.0}"] == 5
    assert got["stepline_gap_seconds_bucket{+Inf}"] == got["stepline_gap_seconds_count"] == 6
    assert got["stepline_gap_seconds_sum"] == pytest.approx(2.665)
