"""A model's loads and unloads, in a log several models share: the summary's `loads`."""

from __future__ import annotations

from collections import Counter

from stepline.events.models import ModelLoaded, ModelLoadFailed, ModelUnloaded
from stepline.events.replay.stats import Distribution, Percentiles, Report

_FAILURES_KEPT = 5  # distinct load-failure messages a summary names


class ModelLoads(Report):
    """A model's loads and unloads, in a log several models share."""

    path: str | None  # what its latest load loaded
    config: dict  # the engine config it serves with (its first load's, resolved)
    num_loads: int
    load_s: Percentiles  # how long each load took
    # its latest load's sizes (None: never loaded)
    weights_bytes: int | None
    kv_bytes: int | None
    prefix_cache_bytes: int | None
    unloads: dict[str, int]  # reason -> how many
    bytes_freed: int  # by its unloads, in total
    num_load_failures: int
    load_failures: dict[str, int]  # message -> how many (the most frequent few)


class LoadTracker:
    """Folds a model's `model-loaded`, `model-load-failed` and `model-unloaded` events."""

    def __init__(self) -> None:
        self.first: ModelLoaded | None = None
        self.latest: ModelLoaded | None = None
        self.num_loads = 0
        self.load_s = Distribution()
        self.unloads: Counter[str] = Counter()
        self.bytes_freed = 0
        self.failures: Counter[str] = Counter()
        self.seen = False

    def add(self, event: ModelLoaded | ModelLoadFailed | ModelUnloaded) -> None:
        self.seen = True
        if isinstance(event, ModelLoaded):
            self.first = self.first or event
            self.latest = event
            self.num_loads += 1
            self.load_s.add(event.load_seconds)
        elif isinstance(event, ModelUnloaded):
            self.unloads[event.reason] += 1
            self.bytes_freed += event.bytes_freed
        else:
            self.failures[event.message] += 1

    def report(self) -> ModelLoads | None:
        if not self.seen:
            return None
        latest = self.latest
        return ModelLoads(
            path=latest.path if latest is not None else None,
            config=self.first.config if self.first is not None else {},
            num_loads=self.num_loads,
            load_s=self.load_s.percentiles(),
            weights_bytes=latest.weights_bytes if latest is not None else None,
            kv_bytes=latest.kv_bytes if latest is not None else None,
            prefix_cache_bytes=latest.prefix_cache_bytes if latest is not None else None,
            unloads=dict(self.unloads.most_common()),
            bytes_freed=self.bytes_freed,
            num_load_failures=self.failures.total(),
            load_failures=dict(self.failures.most_common(_FAILURES_KEPT)),
        )
