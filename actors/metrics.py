"""Engine metrics in Prometheus form, one registry per engine.

What a step changes is counted as it happens, cheaply: a step's token latencies go into
their histograms in one call (`Buckets`, not one locked `Histogram.observe` a token).
What is a state, not an event (requests by phase, the event log's lag, the prefix cache's
size, MLX memory), is read when /metrics is scraped (`Gauge.set_function`), not set every
step: a step only keeps the executor's last report.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from stepline.events.fold import RequestState, Status
from stepline.events.models import FinishReason

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Buckets(Collector):
    """A histogram that takes many values in one call (`observe_many`), exported as
    Prometheus's own histogram family. For the step loop's thread: no lock (a scrape runs
    on the same event loop)."""

    def __init__(
        self, name: str, documentation: str, bounds: Iterable[float], registry: CollectorRegistry
    ) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = tuple(sorted(bounds))
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # a bucket holds values <= its bound
        self.sum += value

    def observe_many(self, values: Collection[float]) -> None:
        counts, bounds = self.counts, self.bounds
        for value in values:
            counts[bisect_left(bounds, value)] += 1
        self.sum += sum(values)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        cumulative, buckets = 0, []
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            cumulative += n
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
        yield HistogramMetricFamily(self.name, self.documentation, buckets, sum_value=self.sum)


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
        # the engine's own (`Admitted.origin`), apart: the two counters above are the clients'
        self.next_turns = Counter(
            "stepline_next_turn_prefills",
            "The engine's prefills of chats' next turns ended, by finish reason (cancelled: a "
            "client's request needed the seat)",
            ["reason"],
            registry=r,
        )
        self.steps = Counter("stepline_steps", "Steps run", registry=r)
        self.heap_trims = Counter(
            "stepline_heap_trims",
            "Times the C heap's free memory went back to the system",
            registry=r,
        )
        self.budget_use = Buckets(
            "stepline_step_budget_use",
            "Fraction of max_step_tokens each step used",
            (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
            r,
        )
        self.step_seconds = Buckets(
            "stepline_step_seconds", "MLX time of one step", _LATENCY_BUCKETS, r
        )
        self.scheduled_tokens = Counter(
            "stepline_scheduled_tokens", "Tokens computed (prefill + decode)", registry=r
        )
        self.generated_tokens = Counter("stepline_generated_tokens", "Tokens sampled", registry=r)
        self.ttft = Buckets(
            "stepline_time_to_first_token_seconds", "Admission to first token", _LATENCY_BUCKETS, r
        )
        self.itl = Buckets(
            "stepline_inter_token_latency_seconds",
            "Time between a request's tokens",
            _LATENCY_BUCKETS,
            r,
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
        self._memory: Any = None  # the executor's last memory counters (engine/memory.py)
        self._prefix: Any = None  # the prefix store's last report (engine/work.PrefixReport)

    def admitted(self, origin: str = "client") -> None:
        if origin == "client":
            self.admissions.inc()

    def finished(self, reason: FinishReason, origin: str = "client") -> None:
        if origin == "client":
            self.requests.labels(reason=str(reason)).inc()
        else:
            self.next_turns.labels(reason=str(reason)).inc()

    def prefix_lookup(self, num_cached_tokens: int) -> None:
        if num_cached_tokens:
            self.prefix_hits.inc()
            self.prefix_cached_tokens.inc(num_cached_tokens)
        else:
            self.prefix_misses.inc()

    def watch(
        self,
        states: Callable[[], Iterable[RequestState]],
        *,
        index: Any = None,  # engine.prefix_index.PrefixIndex (its memory tier), or None
        event_log: Any = None,  # events.log.EventLogWriter, or None
    ) -> None:
        """Read these when /metrics is scraped, on the event loop's thread: the unfinished
        requests' `states`, the prefix index and the event log's health."""

        def in_phase(status: Status) -> Callable[[], float]:
            return lambda: sum(1 for s in states() if s.status is status)

        self.waiting.set_function(in_phase(Status.WAITING))
        self.prefilling.set_function(in_phase(Status.PREFILLING))
        self.running.set_function(in_phase(Status.DECODING))
        if index is not None:
            self.prefix_bytes.set_function(lambda: index.nbytes)
            self.prefix_entries.set_function(lambda: index.num_memory_entries)
            self.prefix_evictions.set_function(lambda: index.evictions)
        if event_log is not None:
            self.event_log_lag.set_function(lambda: event_log.lag)
            self.event_log_degraded.set_function(lambda: 1 if event_log.degraded else 0)
            self.event_log_dropped.set_function(lambda: event_log.num_dropped)

        def last(report: str, name: str) -> Callable[[], float]:
            """A figure of the executor's last report of that kind (0 before the first)."""
            return lambda: getattr(getattr(self, report), name, 0)

        self.prefix_disk_bytes.set_function(last("_prefix", "disk_nbytes"))
        self.prefix_disk_entries.set_function(last("_prefix", "disk_entries"))
        self.prefix_disk_evictions.set_function(last("_prefix", "disk_evictions"))
        self.mlx_active.set_function(last("_memory", "active"))
        self.mlx_cache.set_function(last("_memory", "cache"))
        self.mlx_peak.set_function(last("_memory", "peak"))

    def executor_report(self, memory: Any, prefix: Any) -> None:
        """The executor's last figures (engine.memory's counters, the prefix store's
        report; None where it had none): what the gauges read when scraped."""
        if memory is not None:
            self._memory = memory
        if prefix is not None:
            self._prefix = prefix

    def observe_step(self, work: Any, result: Any, outcome: Any, budget: int) -> None:
        """One step's figures: its tokens, its cache lookups, its budget's use and time, and
        the executor's report (`StepWork`, `StepResult`, `StepOutcome`)."""
        self.tokens(outcome.gaps, outcome.firsts)
        for num_cached in outcome.cache_lookups:
            self.prefix_lookup(num_cached)
        self.step(work.plan.num_tokens, budget, result.seconds)
        self.executor_report(result.memory, result.prefix)

    def step(self, num_tokens: int, budget: int, seconds: float) -> None:
        self.steps.inc()
        self.budget_use.observe(num_tokens / budget)
        self.step_seconds.observe(seconds)
        self.scheduled_tokens.inc(num_tokens)

    def tokens(self, gaps: Collection[float], firsts: Collection[float]) -> None:
        """A step's tokens: the time since each request's previous token (`gaps`), and since
        its admission for those that are its first (`firsts`)."""
        if num := len(gaps) + len(firsts):
            self.generated_tokens.inc(num)
            self.itl.observe_many(gaps)
            self.ttft.observe_many(firsts)
