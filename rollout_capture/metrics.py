"""Per-rollout metrics over call records (spec section 6).

Sums only over calls that report a value, and null when none does: null means unknown,
never zero, so a rollout whose server sent no usage is not counted as free.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

METRIC_FIELDS = (
    "tokens_in",
    "tokens_out",
    "tokens_reasoning",
    "tokens_total",
    "cached_tokens",
    "latency_total_ms",
)


def aggregate_call_dicts(calls: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Metrics of dumped call records (as attached to a rollout)."""
    totals: list[Any] = [None] * len(METRIC_FIELDS)
    count = 0
    for call in calls:
        count += 1
        for index, name in enumerate(METRIC_FIELDS):
            value = call[name]
            if value is not None:
                total = totals[index]
                totals[index] = value if total is None else total + value
    metrics = dict(zip(METRIC_FIELDS, totals, strict=True))
    metrics["num_calls"] = count
    return metrics
