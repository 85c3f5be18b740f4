"""Per-rollout metrics over call records (spec section 6).

Sums only over calls that report a value, and null when none does: null means unknown,
never zero, so a rollout whose server sent no usage is not counted as free. Latencies are
summed as NeMo Gym's ``sum()`` sums them on Python >= 3.12 (compensated), whatever the
interpreter: :mod:`rollout_capture.summation`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rollout_capture.summation import exact_sum

METRIC_FIELDS = (
    "tokens_in",
    "tokens_out",
    "tokens_reasoning",
    "tokens_total",
    "cached_tokens",
    "latency_total_ms",
)


def aggregate_call_dicts(calls: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Metrics of dumped call records (as attached to a rollout).

    One local per field instead of a loop over :data:`METRIC_FIELDS`: it runs per call.
    """
    tokens_in = tokens_out = tokens_reasoning = tokens_total = cached_tokens = None
    latencies: list[Any] = []
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
            tokens_reasoning = value if tokens_reasoning is None else tokens_reasoning + value
        value = call["tokens_total"]
        if value is not None:
            tokens_total = value if tokens_total is None else tokens_total + value
        value = call["cached_tokens"]
        if value is not None:
            cached_tokens = value if cached_tokens is None else cached_tokens + value
        value = call["latency_total_ms"]
        if value is not None:
            latencies.append(value)  # floats: summed at the end, compensated as NeMo Gym's sum()
    return {
        "tokens_in": tokens_in,
        "tokens_out": tokens_out,
        "tokens_reasoning": tokens_reasoning,
        "tokens_total": tokens_total,
        "cached_tokens": cached_tokens,
        "latency_total_ms": exact_sum(latencies) if latencies else None,
        "num_calls": count,
    }
