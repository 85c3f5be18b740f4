"""The quantile sketch: a distribution of non-negative numbers in bounded memory, mergeable.

Exact values while there are at most :data:`EXACT_LIMIT` of them, else log-spaced buckets 2 %
wide (any percentile within 1 % of the true value, at most ~1,100 buckets for 1 ms .. 10 h).
Percentiles use the nearest-rank rule: p50 of ``n`` values is the ``ceil(0.5 n)``-th smallest.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import reduce
from itertools import repeat

from pydantic import BaseModel, Field

EXACT_LIMIT = 1024
"""A sketch keeps its values (exact percentiles) while it holds at most this many."""
GAMMA = 1.02
"""Ratio between the edges of one bucket: a bucket's value is within 1 % of any value in it."""
_LOG_GAMMA = math.log(GAMMA)
_MID = 2 * GAMMA / (1 + GAMMA)  # representative of [g^i, g^(i+1)) is g^i * _MID
PERCENTILES = (50, 90, 99)


class Sketch(BaseModel):
    """A distribution of non-negative numbers in bounded memory, mergeable.

    Exact while ``count <= EXACT_LIMIT`` (``values`` kept), else bucketed on a log scale
    (``buckets``: index ``floor(log_GAMMA(v))`` -> count; ``zeros`` counts the values <= 0).
    ``min``/``max``/``total`` are always exact.
    """

    count: int = 0
    total: float = 0.0
    min: float | None = None
    max: float | None = None
    zeros: int = 0
    buckets: dict[int, int] = Field(default_factory=dict)
    values: list[float] | None = Field(default_factory=list)

    def add(self, value: float) -> None:
        """Count one value (negative values count as 0: a clock step, not a duration)."""
        self.add_many((value,))

    def add_many(self, values: Iterable[float]) -> None:
        """Twin of adding each value in a Python loop (the reference, ``one_by_one`` in
        tests/test_summary.py), proved equal by ``test_add_many_counts_as_one_by_one`` there.

        Several values counted in a few C-level passes over them (this runs for every batch),
        the same result as adding them one by one: buckets in first-seen order, the total
        added in order, the first smallest and largest value kept, ``values`` kept exactly.
        """
        values = values if type(values) is list else list(values)
        if not values:
            return
        smallest = min(values)
        if smallest <= 0:  # rare: values <= 0 count as 0.0, and in no bucket
            zeros = self.zeros + sum(1 for value in values if value <= 0)
            values = [0.0 if value <= 0 else value for value in values]
            positive = [value for value in values if not value <= 0]
            smallest = min(values)
        else:
            zeros, positive = self.zeros, values
        buckets = self.buckets
        if positive:
            keys = map(math.floor, map(operator.mul, map(math.log, positive), repeat(1 / _LOG_GAMMA)))
            for key, n in Counter(keys).items():
                buckets[key] = buckets.get(key, 0) + n
        count = self.count + len(values)
        total = reduce(operator.add, values, self.total)  # in order, as one by one
        low, high = self.min, self.max
        largest = max(values)
        if low is None or smallest < low:
            low = smallest
        if high is None or largest > high:
            high = largest
        # Straight into the fields (no validation runs on assignment anyway): pydantic's
        # __setattr__ costs more than the counting.
        fields = self.__dict__
        fields["count"], fields["total"], fields["zeros"], fields["min"], fields["max"] = (
            count,
            total,
            zeros,
            low,
            high,
        )
        kept = self.values
        if kept is not None:
            if count <= EXACT_LIMIT:
                kept.extend(map(float, values))
            else:
                fields["values"] = None

    def merge(self, other: Sketch) -> Sketch:
        """Add another sketch's values into this one; returns self."""
        if other.count == 0:
            return self
        for key, n in other.buckets.items():
            self.buckets[key] = self.buckets.get(key, 0) + n
        self.zeros += other.zeros
        self.count += other.count
        self.total += other.total
        if other.min is not None and (self.min is None or other.min < self.min):
            self.min = other.min
        if other.max is not None and (self.max is None or other.max > self.max):
            self.max = other.max
        if self.values is not None and other.values is not None and self.count <= EXACT_LIMIT:
            self.values.extend(other.values)
        else:
            self.values = None
        return self

    @property
    def exact(self) -> bool:
        """True when percentiles come from the values themselves."""
        return self.values is not None

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def percentile(self, q: float) -> float | None:
        """The nearest-rank ``q``-th percentile (0 < q <= 100); ``None`` when empty."""
        if not self.count:
            return None
        rank = max(1, math.ceil(q / 100 * self.count))
        if self.values is not None:
            return sorted(self.values)[rank - 1]
        if rank <= self.zeros:
            return 0.0
        seen = self.zeros
        for key in sorted(self.buckets):
            seen += self.buckets[key]
            if seen >= rank:
                value = GAMMA**key * _MID
                return min(max(value, self.min or 0.0), self.max or value)
        return self.max

    def p50_p99(self, unit: str = "") -> str:
        """``p50/p99`` for a log line or a terminal (``120/990 ms``); ``unknown`` when empty."""
        p = self.percentiles()
        if p["p50"] is None or p["p99"] is None:
            return "unknown"
        return f"{p['p50']:,}/{p['p99']:,}" + (f" {unit}" if unit else "")

    def percentiles(self) -> dict[str, int | None]:
        """p50, p90, p99 rounded to whole units (ms, tokens), as the summary shows them."""
        out: dict[str, int | None] = {}
        for q in PERCENTILES:
            value = self.percentile(q)
            out[f"p{q}"] = None if value is None else round(value)
        return out

    def histogram(self, bins: int = 24) -> Histogram:
        """Bins for a chart: log-spaced when the positive values span 10x or more, else linear.

        Values <= 0 are counted apart (``zeros``). Once bucketed, each bucket's count is spread
        over the bins its range overlaps, so bins finer than a bucket show no false comb.
        """
        if self.values is not None:
            spans = [(v, v, 1) for v in self.values if v > 0]
        else:
            lowest, highest = self.min or 0.0, self.max or 0.0
            spans = [
                (max(GAMMA**k, lowest), min(GAMMA ** (k + 1), highest), n)
                for k, n in sorted(self.buckets.items())
            ]
        if not spans:
            return Histogram(zeros=self.zeros)
        low = min(lo for lo, _, _ in spans)
        high = max(hi for _, hi, _ in spans)
        if high <= low:
            return Histogram(zeros=self.zeros, edges=[low, high], counts=[sum(n for _, _, n in spans)])
        log = high / low >= 10

        def position(value: float) -> float:  # 0 at low, bins at high
            if log:
                return math.log(value / low) / math.log(high / low) * bins
            return (value - low) / (high - low) * bins

        counts = [0.0] * bins
        for lo, hi, n in spans:
            start, stop = position(lo), position(max(hi, lo))
            if stop - start < 1e-9:
                counts[min(bins - 1, max(0, int(start)))] += n
                continue
            for index in range(max(0, int(start)), min(bins, math.ceil(stop))):
                overlap = min(stop, index + 1) - max(start, index)
                if overlap > 0:
                    counts[index] += n * overlap / (stop - start)
        steps = [i / bins for i in range(bins + 1)]
        edges = [low * (high / low) ** t for t in steps] if log else [low + (high - low) * t for t in steps]
        return Histogram(zeros=self.zeros, edges=edges, counts=[round(c) for c in counts], log=log)


@dataclass(slots=True)
class Histogram:
    """Chart bins: ``counts[i]`` values in ``[edges[i], edges[i+1])``, plus ``zeros`` (values <= 0)."""

    zeros: int = 0
    edges: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    log: bool = False
