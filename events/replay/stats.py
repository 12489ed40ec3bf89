"""Statistics for replay's reports: percentiles in bounded memory, the k largest items.

Also the base of every replay report (a frozen pydantic model, so `--json` is
`model_dump_json()`).
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    import numpy as np


class Report(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# ---------------------------------------------------------------------------------------------
# Distributions: exact up to a point, then a log-scale histogram (bounded memory).


class Percentiles(Report):
    count: int
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None


_EXACT_LIMIT = 100_000  # samples kept exactly; beyond, a histogram with ~1% relative error
_BIN_GROWTH = 1.01
_BIN_FLOOR = 1e-7  # values below this (and zero) share bin 0


class Distribution:
    """Collects samples for percentiles in bounded memory.

    Exact while it holds at most 100,000 samples; past that it folds them into a log-scale
    histogram whose percentiles are within 1% of the exact ones. Mean and max stay exact.
    Samples wait in a buffer and are folded 100,000 at a time (numpy), so `add` is an append.
    """

    def __init__(self) -> None:
        self._buf: array[float] = array("d")
        self._bins: Counter[int] = Counter()
        self._spilled = 0  # samples folded into the histogram
        self._sum = 0.0
        self._max = -math.inf
        self._min = math.inf

    @property
    def count(self) -> int:
        return self._spilled + len(self._buf)

    def add(self, value: float) -> None:
        buf = self._buf
        buf.append(value)
        if len(buf) > _EXACT_LIMIT:
            self._spill()

    def extend(self, values: array[float] | np.ndarray) -> None:
        """`add` each of `values` (doubles), at C speed."""
        if isinstance(values, array):
            self._buf.extend(values)
        else:
            self._buf.frombytes(values.astype("float64", copy=False).tobytes())
        if len(self._buf) > _EXACT_LIMIT:
            self._spill()

    def _spill(self) -> None:
        """Fold the buffer into the histogram."""
        buf = self._buf
        if not buf:
            return
        import numpy as np  # only for large distributions: importing replay loads no BLAS

        values = np.frombuffer(buf, dtype=np.float64)
        self._sum += float(values.sum())
        self._max = max(self._max, float(values.max()))
        self._min = min(self._min, float(values.min()))
        clipped = np.maximum(values, _BIN_FLOOR) / _BIN_FLOOR
        index = np.where(values <= _BIN_FLOOR, 0, 1 + np.log(clipped) // math.log(_BIN_GROWTH))
        found, counts = np.unique(index.astype(np.int64), return_counts=True)
        self._bins.update(dict(zip(found.tolist(), counts.tolist(), strict=True)))
        self._spilled += len(buf)
        self._buf = array("d")

    @staticmethod
    def _bin(value: float) -> int:
        if value <= _BIN_FLOOR:
            return 0
        return 1 + int(math.log(value / _BIN_FLOOR, _BIN_GROWTH))

    @staticmethod
    def _bin_value(index: int) -> float:
        if index == 0:
            return 0.0
        return _BIN_FLOOR * _BIN_GROWTH ** (index - 0.5)

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0 <= q <= 1), interpolated between exact samples; None if empty."""
        return self._quantiles((q,))[0]

    def _quantiles(self, qs: tuple[float, ...]) -> list[float | None]:
        if self.count == 0:
            return [None for _ in qs]
        if not self._spilled:
            ordered = sorted(self._buf)
            out: list[float | None] = []
            for q in qs:
                pos = q * (len(ordered) - 1)
                lo = math.floor(pos)
                hi = min(lo + 1, len(ordered) - 1)
                out.append(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))
            return out
        self._spill()
        bins = sorted(self._bins.items())
        out = []
        for q in qs:
            rank = q * (self.count - 1)
            seen = 0
            value = self._max
            for index, n in bins:
                seen += n
                if seen > rank:
                    value = min(max(self._bin_value(index), self._min), self._max)
                    break
            out.append(value)
        return out

    def percentiles(self) -> Percentiles:
        if self.count == 0:
            return Percentiles(count=0)
        p50, p90, p99 = self._quantiles((0.5, 0.9, 0.99))
        if self._spilled:
            total, high = self._sum, self._max
        else:
            total, high = math.fsum(self._buf), max(self._buf)
        return Percentiles(
            count=self.count, mean=total / self.count, p50=p50, p90=p90, p99=p99, max=high
        )


def weighted_percentiles(values: array[float], counts: array[int]) -> Percentiles:
    """The percentiles of `values[i]` taken `counts[i]` times each, exactly (as `percentiles`
    of the samples written out gives them, interpolated between neighbours)."""
    total = sum(counts)
    if not total:
        return Percentiles(count=0)
    import numpy as np  # only here: importing replay loads no BLAS

    v = np.frombuffer(values, dtype=np.float64)
    c = np.frombuffer(counts, dtype=np.int64)
    order = np.argsort(v, kind="stable")
    v, c = v[order], c[order]
    ends = np.cumsum(c)  # the sample ranks (0-based) < ends[i] hold v[i]

    def at(rank: int) -> float:
        return float(v[int(np.searchsorted(ends, rank, side="right"))])

    out = []
    for q in (0.5, 0.9, 0.99):
        pos = q * (total - 1)
        lo = math.floor(pos)
        a, b = at(lo), at(min(lo + 1, total - 1))
        out.append(a + (b - a) * (pos - lo))
    return Percentiles(
        count=total,
        mean=float(np.dot(v, c)) / total,
        p50=out[0],
        p90=out[1],
        p99=out[2],
        max=float(v[-1]),
    )


def percentiles(values: Iterable[float]) -> Percentiles:
    dist = Distribution()
    for v in values:
        dist.add(v)
    return dist.percentiles()


class TopK:
    """The k largest items by key, in bounded memory."""

    def __init__(self, k: int) -> None:
        self.k = k
        self._heap: list[tuple[float, int, Any]] = []
        self._n = 0

    def offer(self, key: float, item: Any) -> None:
        if self.k <= 0:
            return
        self._n += 1
        entry = (key, -self._n, item)  # ties: the earlier one wins
        if len(self._heap) < self.k:
            heapq.heappush(self._heap, entry)
        elif entry > self._heap[0]:
            heapq.heapreplace(self._heap, entry)

    def would_take(self, key: float) -> bool:
        """Whether an item with `key` offered now would be kept (so that an item costly to
        build is built only then)."""
        if len(self._heap) < self.k:
            return True
        return self.k > 0 and key > self._heap[0][0]  # ties: the earlier one stays

    def items(self) -> list[Any]:
        return [item for _, _, item in sorted(self._heap, reverse=True)]
