"""What a server of several models (api/pool.py) reports of itself: /health's body
(`health`), its metrics (`metrics`), and its own record in the event log (`RunLog`: the
header that lists the models, and the events no model's engine writes)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import GaugeMetricFamily, Metric

from stepline.actors.scheduler.core import LogPlace
from stepline.api.config import EventLogConfig, PoolConfig
from stepline.events.feed import EventFeed
from stepline.events.models import (
    FinishReason,
    LogHeader,
    ModelLoadFailed,
    Terminal,
    new_run_id,
    new_salt,
)

if TYPE_CHECKING:
    from stepline.api.pool import ModelPool


def health(pool: ModelPool) -> dict[str, Any]:
    """/health's body: each model's state (loaded, unloaded, loading, unloading, failed:
    with why), the memory used of the budget; `degraded` when a model failed to load or
    the event log stopped writing."""
    models: dict[str, Any] = {}
    degraded = False
    for name, e in pool.entries.items():
        about: dict[str, Any] = {"state": str(e.state)}
        if e.engine is not None:
            if e.engine.warming_up:
                about["warming_up"] = True
            if (reason := e.engine.unhealthy_reason) is not None:
                about.update(state="failed", error=reason.split(":", 1)[0])
        if e.error is not None and e.state == "failed":
            about["error"] = e.error
        if e.refused is not None:
            about.update(state="refused", error=e.refused)
        degraded |= about["state"] in ("failed", "refused")
        models[name] = about
    body: dict[str, Any] = {
        "status": "degraded" if degraded else "ok",
        "models": models,
        "memory_gb": {
            "used": round(pool.used_bytes / 2**30, 3),
            "budget": round(pool.budget_bytes / 2**30, 3),
        },
    }
    if (lost := pool.run_log.problem) is not None:
        body.update(status="degraded", event_log=lost)
    return body


def metrics(pool: ModelPool) -> Iterator[Metric]:
    """Every loaded model's metrics, each sample labelled with its `model`, and the pool's
    own: whether each model is loaded, and the memory they use of the budget."""
    merged: dict[str, Metric] = {}
    for entry in pool.loaded():
        assert entry.engine is not None
        for metric in entry.engine.metrics.registry.collect():
            into = merged.get(metric.name)
            if into is None:
                into = merged[metric.name] = Metric(
                    metric.name, metric.documentation, metric.type, metric.unit
                )
            for sample in metric.samples:
                labels = {**sample.labels, "model": entry.spec.name}
                into.add_sample(
                    sample.name, labels, sample.value, sample.timestamp, sample.exemplar
                )
    yield from merged.values()
    loaded = GaugeMetricFamily(
        "stepline_model_loaded", "whether the model is loaded (1) or not (0)", labels=["model"]
    )
    for name, e in pool.entries.items():
        loaded.add_metric([name], 1.0 if e.state == "loaded" else 0.0)
    yield loaded
    yield GaugeMetricFamily(
        "stepline_models_memory_bytes",
        "memory the loaded models take (weights, KV budget, prefix cache)",
        value=pool.used_bytes,
    )
    yield GaugeMetricFamily(
        "stepline_models_memory_budget_bytes",
        "memory all models may take together (--max-memory-gb)",
        value=pool.budget_bytes,
    )


class RunLog:
    """The pool's one event log (None: no log), and the events of no model's engine: a
    request refused before it had a model (under the run: model None, in a sequence of the
    run's own) and a failed load (in its model's sequence). Its `feed` is the run's events
    for live readers (GET /v1/events), every model's."""

    def __init__(self, writer: Any, feed: EventFeed | None = None):
        self.writer = writer
        self.feed = feed
        self._seq = 0  # the last sequence number of the run's own events (model None)

    @classmethod
    def open(cls, config: PoolConfig, events: EventLogConfig) -> RunLog:
        """The log `events` names, appended to, its header listing `config`'s models (none
        without a name: the feed then keeps the events in memory alone)."""
        header = LogHeader(
            created=time.time(),
            models={s.name: s.model_dump() for s in config.models},
            log_prompts=events.log_prompts,
            log_outputs=events.log_outputs,
            run_id=new_run_id(),
            salt=new_salt(),
        )
        writer = None
        if events.event_log is not None:
            from stepline.events.log import EventLogWriter

            writer = EventLogWriter(
                events.event_log, header, rotate_bytes=events.rotate_bytes, append=True
            )
        return cls(writer, EventFeed.of_log(header, writer, events.events_in_memory))

    def _record(self, event: Any) -> None:
        if self.writer is not None:
            self.writer.append(event)
        if self.feed is not None:
            self.feed.publish([event])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    @property
    def problem(self) -> str | None:
        """Why events are lost, once the log stopped writing."""
        writer = self.writer
        if writer is None or not writer.degraded:
            return None
        return f"{writer.error_message}; {writer.num_dropped} events dropped"

    def refusal(self, request_id: str, message: str, *, code: str, status: int) -> None:
        """A lone `terminal` (rejected) under the run."""
        if self.writer is None and self.feed is None:
            return
        self._seq += 1
        self._record(
            Terminal(
                seq=self._seq,
                ts=time.time(),
                step=0,
                request_id=request_id,
                reason=FinishReason.REJECTED,
                message=message,
                code=code,
                status=status,
            )
        )

    def load_failed(self, place: LogPlace, message: str) -> LogPlace:
        """`model-load-failed` after `place` in its model's sequence; returns where the
        model's events go on."""
        if self.writer is None and self.feed is None:
            return place
        self._record(
            ModelLoadFailed(
                seq=place.seq + 1,
                ts=time.time(),
                step=place.step + 1,
                model=place.model,
                message=message,
            )
        )
        return LogPlace(place.model, place.seq + 1, place.step)
