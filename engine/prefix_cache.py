"""The prefix cache: prompt-cache snapshots keyed by the tokens they hold.

Entries come from checkpoint snapshots (taken during prefill at exactly their
offset) and from finished requests. A lookup returns the longest usable prefix
of a prompt, by these rules:

- An entry holding exactly the first k tokens of the prompt is usable at k, for
  every cache kind (its state is the state after exactly those k tokens).
- An entry that shares only its first m < k tokens with the prompt is usable at m
  only if every layer can be trimmed (`KVCache`, `RotatingKVCache` before it
  wraps). Recurrent layers (`ArraysCache`) cannot be cut back: such an entry is
  never used at any offset but its own, and the lookup falls back to the nearest
  earlier entry instead.
- At least one prompt token is always left to compute, since the first output
  token needs its logits.

Entries are shared, not copied, between the requests that hit them: a hit gets new
cache objects viewing the same MLX arrays, and MLX copies a buffer only when one
of them writes to it. Memory is bounded by a byte budget, least recently used out.
Runs on the executor thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import PromptTrie, can_trim_prompt_cache

Cache = list[Any]
_MODEL = "m"  # PromptTrie keys entries by model; one cache serves one model


def _alias_tree(x: Any) -> Any:
    if isinstance(x, mx.array):
        return x[...]  # a new array object viewing the same buffer: copy-on-write
    if isinstance(x, list):
        return [_alias_tree(v) for v in x]
    if isinstance(x, tuple):
        return tuple(_alias_tree(v) for v in x)
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


def cache_nbytes(cache: Cache) -> int:
    return sum(layer.nbytes for layer in cache)


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    cache: Cache
    nbytes: int
    trimmable: bool


@dataclass(frozen=True)
class PrefixHit:
    num_tokens: int  # prompt tokens the cache already holds
    cache: Cache  # this request's own cache objects (sharing the entry's arrays)
    source: str  # "memory"


@dataclass
class PrefixCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    inserts: int = 0
    nbytes: int = 0
    entries: int = 0
    cached_tokens: int = 0  # prompt tokens served from the cache, in total


class PrefixCache:
    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"prefix cache max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._trie = PromptTrie()
        self._lru: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()  # oldest use first
        self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        return len(self._lru)

    def insert(self, tokens: Sequence[int], cache: Cache) -> None:
        """Keep `cache`, whose state is exactly that after `tokens`. The caller gives it up."""
        key = tuple(tokens)
        if not key:
            return
        entry = _Entry(key, cache, cache_nbytes(cache), can_trim_prompt_cache(cache))
        if entry.nbytes > self.max_bytes:
            return
        old = self._lru.pop(key, None)
        if old is not None:
            self.stats.nbytes -= old.nbytes
        self._trie.add(_MODEL, list(key), entry)
        self._lru[key] = entry
        self.stats.nbytes += entry.nbytes
        self.stats.inserts += 1
        if entry.trimmable:
            # Trimmable prefixes of this entry are redundant: it can serve them all.
            for n, prefix in self._trie.pop_prefixes(_MODEL, list(key)):
                if prefix.trimmable and n < len(key):
                    self._drop(key[:n], count=False)
                else:
                    self._trie.add(_MODEL, list(key[:n]), prefix)  # keep: put it back
        self._evict()
        self.stats.entries = len(self._lru)

    def _drop(self, key: tuple[int, ...], *, count: bool) -> None:
        entry = self._lru.pop(key, None)
        if entry is None:
            return
        try:
            self._trie.pop(_MODEL, list(key))
        except KeyError:
            pass  # already taken out of the trie by pop_prefixes
        self.stats.nbytes -= entry.nbytes
        if count:
            self.stats.evictions += 1

    def _evict(self) -> None:
        while self.stats.nbytes > self.max_bytes and self._lru:
            self._drop(next(iter(self._lru)), count=True)
        self.stats.entries = len(self._lru)

    def lookup(self, prompt: Sequence[int]) -> PrefixHit | None:
        """The longest usable cached prefix of `prompt` (at most len(prompt) - 1 tokens)."""
        best: tuple[int, _Entry] | None = None
        if len(prompt) >= 2 and self._lru:
            wanted = list(prompt[: len(prompt) - 1])
            found = self._trie.search(_MODEL, wanted)
            if found.exact is not None:
                best = (len(wanted), self._trie.get(_MODEL, found.exact))
            else:
                if found.shorter is not None:
                    best = (len(found.shorter), self._trie.get(_MODEL, found.shorter))
                if found.longer is not None and found.common_prefix > (best[0] if best else 0):
                    entry = self._trie.get(_MODEL, found.longer)
                    if entry.trimmable:
                        best = (found.common_prefix, entry)
        if best is None:
            self.stats.misses += 1
            return None
        n, entry = best
        self._lru.move_to_end(entry.tokens)
        cache = share_cache(entry.cache)
        if n < len(entry.tokens):
            for layer in cache:
                layer.trim(len(entry.tokens) - n)
        self.stats.hits += 1
        self.stats.cached_tokens += n
        return PrefixHit(num_tokens=n, cache=cache, source="memory")
