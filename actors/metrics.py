"""Engine metrics in Prometheus form, one registry per engine."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from stepline.events.fold import RequestState, Status
from stepline.events.models import FinishReason

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class EngineMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.waiting = Gauge(
            "stepline_requests_waiting", "Admitted, not yet prefilling", registry=r
        )
        self.prefilling = Gauge("stepline_requests_prefilling", "Mid-prefill", registry=r)
        self.running = Gauge("stepline_requests_decoding", "Generating tokens", registry=r)
        self.healthy = Gauge(
            "stepline_healthy",
            "1 while the engine serves (executor and step loop alive)",
            registry=r,
        )
        self.healthy.set(1)
        self.requests = Counter(
            "stepline_requests", "Requests ended, by finish reason", ["reason"], registry=r
        )
        self.admissions = Counter("stepline_requests_admitted", "Requests admitted", registry=r)
        self.steps = Counter("stepline_steps", "Steps run", registry=r)
        self.budget_use = Histogram(
            "stepline_step_budget_use",
            "Fraction of max_step_tokens each step used",
            buckets=(0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
            registry=r,
        )
        self.step_seconds = Histogram(
            "stepline_step_seconds", "MLX time of one step", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.scheduled_tokens = Counter(
            "stepline_scheduled_tokens", "Tokens computed (prefill + decode)", registry=r
        )
        self.generated_tokens = Counter("stepline_generated_tokens", "Tokens sampled", registry=r)
        self.ttft = Histogram(
            "stepline_time_to_first_token_seconds",
            "Admission to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "stepline_inter_token_latency_seconds",
            "Time between a request's tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prefix_hits = Counter(
            "stepline_prefix_cache_hits", "Requests that started from a cached prefix", registry=r
        )
        self.prefix_misses = Counter(
            "stepline_prefix_cache_misses", "Requests with no usable cached prefix", registry=r
        )
        self.prefix_cached_tokens = Counter(
            "stepline_prefix_cache_tokens", "Prompt tokens served from the cache", registry=r
        )
        self.prefix_evictions = Gauge(
            "stepline_prefix_cache_evictions", "Entries evicted since start", registry=r
        )
        self.prefix_bytes = Gauge("stepline_prefix_cache_bytes", "Bytes held", registry=r)
        self.prefix_entries = Gauge("stepline_prefix_cache_entries", "Entries held", registry=r)
        self.prefix_disk_bytes = Gauge(
            "stepline_prefix_cache_disk_bytes", "Disk tier: file bytes held", registry=r
        )
        self.prefix_disk_entries = Gauge(
            "stepline_prefix_cache_disk_entries", "Disk tier: entries held", registry=r
        )
        self.prefix_disk_evictions = Gauge(
            "stepline_prefix_cache_disk_evictions", "Disk tier: files evicted", registry=r
        )
        self.mlx_active = Gauge(
            "stepline_mlx_active_bytes", "MLX memory held by live arrays", registry=r
        )
        self.mlx_cache = Gauge(
            "stepline_mlx_cache_bytes", "MLX buffer cache: freed memory kept for reuse", registry=r
        )
        self.mlx_peak = Gauge("stepline_mlx_peak_bytes", "MLX peak active memory", registry=r)
        self.event_log_lag = Gauge(
            "stepline_event_log_lag_events", "Events recorded, not yet written", registry=r
        )
        self.event_log_degraded = Gauge(
            "stepline_event_log_degraded", "1 once the event log failed to write", registry=r
        )
        self.event_log_dropped = Gauge(
            "stepline_event_log_dropped_events",
            "Events not written because the log failed (since it failed)",
            registry=r,
        )

    def admitted(self) -> None:
        self.admissions.inc()

    def finished(self, reason: FinishReason) -> None:
        self.requests.labels(reason=str(reason)).inc()

    def prefix_lookup(self, num_cached_tokens: int) -> None:
        if num_cached_tokens:
            self.prefix_hits.inc()
            self.prefix_cached_tokens.inc(num_cached_tokens)
        else:
            self.prefix_misses.inc()

    def prefix_cache(self, index, report) -> None:
        """From the step loop's index (memory tier) and the store's last report (disk)."""
        self.prefix_bytes.set(index.nbytes)
        self.prefix_entries.set(index.num_memory_entries)
        self.prefix_evictions.set(index.evictions)
        self.prefix_disk_bytes.set(report.disk_nbytes)
        self.prefix_disk_entries.set(report.disk_entries)
        self.prefix_disk_evictions.set(report.disk_evictions)

    def memory(self, counters) -> None:
        if counters is not None:
            self.mlx_active.set(counters.active)
            self.mlx_cache.set(counters.cache)
            self.mlx_peak.set(counters.peak)

    def step(self, num_tokens: int, budget: int, seconds: float) -> None:
        self.steps.inc()
        self.budget_use.observe(num_tokens / budget)
        self.step_seconds.observe(seconds)
        self.scheduled_tokens.inc(num_tokens)

    def tokens(self, latencies: list[tuple[float, bool]]) -> None:
        """A step's tokens: for each, the time since its request's admission (its first
        token) or since its previous token."""
        if not latencies:
            return
        self.generated_tokens.inc(len(latencies))
        for latency, first in latencies:
            (self.ttft if first else self.itl).observe(latency)

    def event_log(self, writer) -> None:
        """The event log's health (`events.log.EventLogWriter`), when there is one."""
        if writer is not None:
            self.event_log_lag.set(writer.lag)
            self.event_log_degraded.set(1 if writer.degraded else 0)
            self.event_log_dropped.set(writer.num_dropped)

    def gauges(self, states: Iterable[RequestState]) -> None:
        counts = dict.fromkeys(Status, 0)
        for s in states:
            counts[s.status] += 1
        self.waiting.set(counts[Status.WAITING])
        self.prefilling.set(counts[Status.PREFILLING])
        self.running.set(counts[Status.DECODING])
