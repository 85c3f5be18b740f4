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
    tokens_in = tokens_out = reasoning = total = cached = latency = None
    count = 0
    for call in calls:
        count += 1
        value = call["tokens_in"]
        if value is not None:
            tokens_in = value if tokens_in is None else tokens_in + value
        value = call["tokens_out"]
        if value is not None:
            tokens_out = value if tokens_out is None else tokens_out + value
        value = call["tokens_reasoning"]
        if value is not None:
            reasoning = value if reasoning is None else reasoning + value
        value = call["tokens_total"]
        if value is not None:
            total = value if total is None else total + value
        value = call["cached_tokens"]
        if value is not None:
            cached = value if cached is None else cached + value
        value = call["latency_total_ms"]
        if value is not None:
            latency = value if latency is None else latency + value
    return {
        "tokens_in": tokens_in,
        "tokens_out": tokens_out,
        "tokens_reasoning": reasoning,
        "tokens_total": total,
        "cached_tokens": cached,
        "latency_total_ms": latency,
        "num_calls": count,
    }
