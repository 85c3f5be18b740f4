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
    totals: dict[str, Any] = dict.fromkeys(METRIC_FIELDS)
    count = 0
    for call in calls:
        count += 1
        for name in METRIC_FIELDS:
            value = call.get(name)
            if value is not None:
                current = totals[name]
                totals[name] = value if current is None else current + value
    totals["num_calls"] = count
    return totals
