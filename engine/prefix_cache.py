"""The prefix cache's arrays: prompt-cache snapshots kept by the tokens they hold.

`PrefixStore` lives on the executor thread and only stores: entries come from
checkpoint snapshots (taken during prefill at exactly their offset) and from finished
requests; the step loop's `PrefixIndex` (actors/scheduler/prefix_index.py) decides which entry a
request starts from and which entries are evicted, and the store reports back what it
added and what its disk tier (engine/prefix_disk.py) gained or lost.

An entry owns exactly its arrays: a snapshot or a retired batch row is copied out of
the live cache (`compact_cache`), because a view would keep its whole parent buffer
alive — a 256-token growth block, or the entire decode batch — and the memory the
cache reports would be a fraction of what it holds. Hits share an entry's arrays
(`share_cache`); MLX copies a buffer only when one of them writes to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    KVCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    make_prompt_cache,
)

from stepline.actors.scheduler.prefix_index import EntryInfo, Tokens
from stepline.actors.scheduler.work import PrefixReport
from stepline.engine.kv_quant import QuantizedKVCache
from stepline.engine.prefix_disk import DiskTier
from stepline.engine.prefix_files import Layout

Cache = list[Any]


def exact_only(model: Any) -> bool:
    """Whether a prefix of `model`'s cache may serve only at the offset it was taken at: a
    recurrent layer (its state cannot be cut back) or a sliding window (it can once it has
    wrapped). A prompt is then also snapshotted one token before its end, so the same
    prompt sent again reuses all but its last token (`ModelLimits.exact_prefixes`)."""
    cache = make_prompt_cache(model)
    return not can_trim_prompt_cache(cache) or any(isinstance(c, RotatingKVCache) for c in cache)


def _alias_tree(x: Any) -> Any:
    if isinstance(x, mx.array):
        return x[...]  # a new array object viewing the same buffer: copy-on-write
    if isinstance(x, list):
        return [_alias_tree(v) for v in x]
    if isinstance(x, tuple):
        return tuple(_alias_tree(v) for v in x)
    return x


def _own_tree(x: Any) -> Any:
    if isinstance(x, mx.array):
        return mx.contiguous(x)  # a view gets its own buffer; its parent can be freed
    if isinstance(x, list):
        return [_own_tree(v) for v in x]
    if isinstance(x, tuple):
        return tuple(_own_tree(v) for v in x)
    return x


def share_cache(cache: Cache) -> Cache:
    """New cache objects over the same arrays; writes to either never reach the other."""
    out = []
    for layer in cache:
        copy = type(layer).__new__(type(layer))
        copy.__dict__.update(layer.__dict__)
        copy.state = _alias_tree(layer.state)
        out.append(copy)
    return out


def compact_cache(cache: Cache) -> Cache:
    """Cache objects holding exactly their tokens in buffers of their own, evaluated.

    KV layers (plain or quantized) lose the unused rest of their growth block; any array
    that views a larger buffer (a batch row, a slice) is copied out of it.
    """
    out = []
    for layer in cache:
        copy = type(layer).__new__(type(layer))
        copy.__dict__.update(layer.__dict__)
        if type(layer) in (KVCache, QuantizedKVCache) and layer.keys is not None:
            copy.keys, copy.values = (
                _first(layer.keys, layer.offset),
                _first(layer.values, layer.offset),
            )
        copy.state = _own_tree(copy.state)
        out.append(copy)
    mx.eval([c.state for c in out])
    return out


def _first(x: Any, n: int) -> Any:
    """A KV layer's array (or quantized triple of them) cut to its first `n` tokens."""
    if isinstance(x, tuple):
        return tuple(a[..., :n, :] for a in x)
    return x[..., :n, :]


def cache_nbytes(cache: Cache) -> int:
    return sum(layer.nbytes for layer in cache)


class PrefixStore:
    """Entries' arrays by their tokens, plus the optional disk tier (executor thread)."""

    def __init__(
        self,
        *,
        disk_dir: str | Path | None = None,
        disk_max_bytes: int = 0,
        model_id: str = "",
        layout: Layout | None = None,
    ):
        self._entries: dict[Tokens, Cache] = {}
        self._new: list[EntryInfo] = []
        self.disk = (
            DiskTier(disk_dir, disk_max_bytes, model_id, layout=layout)
            if disk_dir is not None
            else None
        )

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, tokens: Tokens) -> bool:
        return tokens in self._entries

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays held in memory (what they really keep alive: see module)."""
        return sum(cache_nbytes(c) for c in self._entries.values())

    def put(self, tokens: Sequence[int], cache: Cache, *, persist: bool = True) -> EntryInfo:
        """Keep a copy of `cache`, whose state is exactly that after `tokens`."""
        key = tuple(tokens)
        own = compact_cache(cache)
        info = EntryInfo(key, cache_nbytes(own), can_trim_prompt_cache(own))
        if persist and self.disk is not None:
            self.disk.offer(key, own, info.trimmable)
        self._entries[key] = own
        self._new.append(info)
        return info

    def get(self, tokens: Tokens, num_tokens: int) -> Cache:
        """A request's own cache objects for the entry, cut back to `num_tokens`."""
        mine = share_cache(self._entries[tokens])
        if num_tokens < len(tokens):
            for layer in mine:
                layer.trim(len(tokens) - num_tokens)
        if self.disk is not None:
            self.disk.touch(tokens)
        return mine

    def drop(self, tokens: Tokens) -> None:
        self._entries.pop(tokens, None)

    def promote(self, tokens: Tokens) -> bool:
        """Load a disk entry into memory; False if its file turned out unusable (then the
        disk tier drops it and reports so)."""
        entry = self.disk.get(tokens) if self.disk is not None else None
        if entry is None or self.disk is None:
            return False
        cache = self.disk.load(entry)
        if cache is None:
            return False
        self.put(tokens, cache, persist=False)
        return True

    def disk_entries(self) -> list[EntryInfo]:
        """Everything on disk now (for seeding a new index); clears pending changes."""
        if self.disk is None:
            return []
        self.disk.take_changes()
        return [EntryInfo(e.tokens, e.nbytes, e.trimmable) for e in self.disk.entries()]

    def take_report(self) -> PrefixReport:
        """What the store did since the last report (for the step loop's index), and its
        disk tier's counters."""
        new, self._new = self._new, []
        if self.disk is None:
            return PrefixReport(new=tuple(new))
        added, removed = self.disk.take_changes()
        stats = self.disk.stats
        return PrefixReport(
            new=tuple(new),
            disk_added=tuple(added),
            disk_removed=tuple(removed),
            disk_nbytes=stats.nbytes,
            disk_entries=stats.entries,
            disk_evictions=stats.evictions,
        )

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the disk tier's queued writes are on disk (True at once without one)."""
        return True if self.disk is None else self.disk.flush(timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        """Let the queued disk writes finish and stop the writer thread."""
        if self.disk is not None:
            self.disk.close(timeout)
