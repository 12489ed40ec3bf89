"""The policy of a server of several models: whose step runs next on the one executor thread,
and which models stay loaded. Pure functions of the state they are given, MLX-free, tested
without a model (tests/test_model_policy.py); `actors/turns.py` and `api/pool.py` apply them.

Steps: round robin between the models that have a step waiting, in the order the models are
configured, starting after the model that ran last. Each step is sized by its own model's
scheduler, within its own model's token budget and time target; a model's streams then see
the other models' steps between theirs (two models decoding: a token every two steps' time).

Memory: a model's footprint is its weights, its running requests' KV budget and its prefix
cache's budget. Loading one that does not fit beside the loaded ones unloads the least
recently used models that are idle and not pinned until it fits; a model with requests in
flight is never unloaded. One that cannot fit even alone is refused.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass


def next_turn(waiting: Collection[str], order: Sequence[str], last: str | None) -> str | None:
    """The model whose step runs next: of those `waiting`, the first after `last` in `order`
    (wrapping around); None when none waits. A waiting model `order` does not name goes after
    the named ones."""
    if not waiting:
        return None
    ring = [*order, *sorted(set(waiting) - set(order))]
    start = ring.index(last) + 1 if last in ring else 0
    return next(m for m in ring[start:] + ring[:start] if m in waiting)


@dataclass(frozen=True)
class Resident:
    """A loaded model, as the memory policy sees it."""

    name: str
    footprint_bytes: int  # weights + KV budget + prefix-cache budget
    last_used: float  # when it last had a request (monotonic seconds)
    busy: bool  # requests in flight (or on their way): never unloaded under them
    pinned: bool  # never unloaded for room (nor for idleness)


class DoesNotFitError(ValueError):
    """A model's footprint is larger than the whole memory budget."""

    def __init__(self, name: str, need: int, budget: int):
        self.name, self.need, self.budget = name, need, budget
        super().__init__(
            f"the model {name!r} needs {_gb(need)} (weights, KV budget and prefix cache), more "
            f"than the server's whole memory budget of {_gb(budget)}: raise --max-memory-gb, or "
            f"give it a smaller max_kv_gb / prefix_cache_gb"
        )


def to_unload(
    residents: Sequence[Resident], need_bytes: int, budget_bytes: int, name: str = "the model"
) -> list[str] | None:
    """The models to unload so that `need_bytes` more fit in `budget_bytes` beside the rest:
    the least recently used idle, unpinned ones first, as few as needed ([] when it fits as
    is). None when it cannot fit now, the busy and pinned ones being in the way (it may once
    they are idle). Raises DoesNotFitError when `need_bytes` alone is over the budget."""
    if need_bytes > budget_bytes:
        raise DoesNotFitError(name, need_bytes, budget_bytes)
    used = sum(r.footprint_bytes for r in residents)
    chosen: list[str] = []
    for r in sorted(residents, key=lambda r: r.last_used):
        if used + need_bytes <= budget_bytes:
            break
        if r.busy or r.pinned:
            continue
        chosen.append(r.name)
        used -= r.footprint_bytes
    return chosen if used + need_bytes <= budget_bytes else None


def expired(residents: Sequence[Resident], ttl_s: dict[str, float | None], now: float) -> list[str]:
    """The models idle for longer than their time to live (`ttl_s[name]`, None: forever),
    pinned ones never."""
    return [
        r.name
        for r in residents
        if not r.busy
        and not r.pinned
        and (ttl := ttl_s.get(r.name)) is not None
        and now - r.last_used > ttl
    ]


def _gb(n: int) -> str:
    return f"{n / 2**30:.2f} GB"
