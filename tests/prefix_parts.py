"""The prefix cache's two halves joined by hand, as the engine joins them, for tests of the
pair without an engine: the step loop's index (actors/scheduler/prefix_index.py) says which entry a
request starts from; the executor's store (engine/prefix_cache.py) holds the arrays and
reports what it added or lost."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from stepline.actors.scheduler.prefix_index import Candidate, PrefixIndex, plan_prefixes
from stepline.engine.prefix_cache import Cache, PrefixStore


@dataclass(frozen=True)
class Hit:
    num_tokens: int  # prompt tokens the request's cache starts with
    cache: Cache  # the request's own cache objects (the runner's `store.get`)
    source: str  # "memory" or "disk", as its first `chunk-prefilled` event says


class Prefixes:
    """An index of `max_bytes` over a store made with `store`'s arguments (its disk tier's
    entries seed the index, as api/engine_parts.py does)."""

    def __init__(self, max_bytes: int, **store: Any) -> None:
        self.store = PrefixStore(**store)
        self.index = PrefixIndex(max_bytes)
        for info in self.store.disk_entries():
            self.index.add_disk(info.tokens, info.trimmable)

    def report(self) -> None:
        """The store's changes into the index (`SchedulerCore.apply_prefix_report`), and the
        entries the index lets go out of the store (the next housekeeping's `drop_entries`)."""
        report = self.store.take_report()
        for tokens in self.index.apply(report.new, report.disk_added, report.disk_removed):
            self.store.drop(tokens)

    def put(self, tokens: Sequence[int], cache: Cache) -> None:
        """A checkpoint's snapshot, or a finished request's cache, into the store."""
        self.store.put(tokens, cache)
        self.report()

    def flush(self) -> None:
        """Wait for the disk writes so far, and tell the index."""
        assert self.store.flush(30.0)
        self.report()

    def lookup(self, prompt: Sequence[int]) -> Hit | None:
        """Where a request for `prompt` starts: the core's plan (`plan_prefixes`); when its
        entry is only on disk, the store loads it (housekeeping's `promote`) and the next
        step's plan, which loads no more for it, decides; then the runner takes the entry."""
        request = Candidate("r", prompt, 0, (), waiting=True)
        plan = plan_prefixes([request], self.index)
        source = "memory"
        if plan.promote:
            for tokens in plan.promote:
                self.store.promote(tokens)
            self.report()
            source = "disk"
            plan = plan_prefixes([replace(request, allow_disk=False)], self.index)
        match = plan.matches.get(request.request_id)
        if match is None:
            return None
        self.index.touch(match.tokens)
        return Hit(match.num_tokens, self.store.get(match.tokens, match.num_tokens), source)
