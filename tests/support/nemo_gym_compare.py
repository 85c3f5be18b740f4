"""Records compared field by field with NeMo Gym 0.7.0's: what differs, and only where documented.

Shared by the NeMo Gym tier (tests/test_nemo_gym_070*.py) and the projections' unit tests
(tests/test_projections.py): a difference is a path and both values, and ours may add only the
fields and keys contract sections 5, 7 and 12 document.
"""

from __future__ import annotations

import re
import sys
from typing import Any

DOCUMENTED_CALL_FIELDS = frozenset({"verifier_invocation_id", "capture_hold_ms"})
"""Call-record fields ours adds (contract section 5, extensions)."""
DOCUMENTED_ATTACHMENT_KEYS = frozenset({"verifier_invocations", "metrics_by_owner"})
"""Attachment keys ours adds (contract section 7, extensions), only where there are verifier calls."""
DOCUMENTED_GAP_CODES = frozenset({"ng_perf_unavailable", "model_call_timing_impossible"})
"""Gaps ours adds: a NeMo Gym projection removed, saying why (contract section 14); a call whose
timing cannot be the model's (section 7)."""


class Tally:
    """What a comparison counted: records, calls, calls equal field by field, and each difference."""

    def __init__(self) -> None:
        self.records = self.calls = self.equal = 0
        self.differences: list[str] = []

    def __str__(self) -> str:
        return f"{self.records} records, {self.calls} calls, {self.equal} equal"


def compare(theirs: list[dict[str, Any]], ours: list[dict[str, Any]], tally: Tally) -> None:
    """Every record field by field; ours may only add the documented fields."""
    assert len(theirs) == len(ours)
    for index, (gym, mine) in enumerate(zip(theirs, ours, strict=True)):
        tally.records += 1
        where = f"record {index}"
        gym, mine = dict(gym), dict(mine)
        gym_capture, my_capture = (
            gym.pop("ng_model_call_capture", None),
            mine.pop("ng_model_call_capture", None),
        )
        note_differences(gym, mine, where, tally.differences)
        if gym_capture is None or my_capture is None:
            if gym_capture is not my_capture:
                tally.differences.append(f"{where}: attached by one merge only")
            continue
        gym_capture, my_capture = dict(gym_capture), dict(my_capture)  # the records stay as they came
        if "gaps" in my_capture:
            kept = [gap for gap in my_capture["gaps"] if gap.get("code") not in DOCUMENTED_GAP_CODES]
            if kept or "gaps" in gym_capture:
                my_capture["gaps"] = kept
            else:
                del my_capture["gaps"]
        for key in set(my_capture) - set(gym_capture):
            if key not in DOCUMENTED_ATTACHMENT_KEYS:
                tally.differences.append(f"{where}: ours adds {key}")
        gym_calls, my_calls = gym_capture.pop("calls"), my_capture.pop("calls")
        note_differences(
            gym_capture, {k: my_capture[k] for k in gym_capture if k in my_capture}, where, tally.differences
        )
        if len(gym_calls) != len(my_calls):
            tally.differences.append(f"{where}: {len(gym_calls)} calls against our {len(my_calls)}")
            continue
        for n, (gym_call, my_call) in enumerate(zip(gym_calls, my_calls, strict=True)):
            tally.calls += 1
            found: list[str] = []
            for key in set(my_call) - set(gym_call):
                if key not in DOCUMENTED_CALL_FIELDS:
                    found.append(f"{where} call {n}: ours adds {key}")
            note_differences(
                gym_call, {k: my_call.get(k, "<missing>") for k in gym_call}, f"{where} call {n}", found
            )
            tally.equal += not found
            tally.differences += found


def note_differences(theirs: Any, ours: Any, where: str, found: list[str]) -> None:
    """Each place where ``ours`` is not ``theirs`` into ``found``: equal values of equal types (a
    float is not an int, 11.03 is not 11.030000000000001), dicts and lists compared item by item."""
    if isinstance(theirs, dict) and isinstance(ours, dict):
        for key in sorted(set(theirs) | set(ours)):
            note_differences(
                theirs.get(key, "<missing>"), ours.get(key, "<missing>"), f"{where}.{key}", found
            )
    elif isinstance(theirs, list) and isinstance(ours, list) and len(theirs) == len(ours):
        for n, (a, b) in enumerate(zip(theirs, ours, strict=True)):
            note_differences(a, b, f"{where}[{n}]", found)
    elif type(theirs) is not type(ours) or theirs != ours:
        found.append(f"{where}: NeMo Gym {theirs!r}, ours {ours!r}")


def print_counts(name: str, tally: Tally) -> None:
    """One line in the test's output for the closing note."""
    print(f"\n[nemo-gym 0.7.0] {name}: {tally}", file=sys.stderr)


# ---------------------------------------------------------------- two runs of one scenario

TIMING_KEYS = frozenset(
    {
        "started_at",
        "completed_at",
        "latency_ms",
        "latency_total_ms",
        "latency_ttft_ms",
        "duration_ms",
        "timestamp",
        "total_latency_ms",
        "capture_hold_ms",
        "created_at",
        "created",
    }
)
"""What two runs of one scenario measure differently: the clock (contract section 14)."""
_GENERATED_ID = re.compile(r"^(?:(?:resp|msg|rs|fc|chatcmpl)[_-])?[0-9a-f]{32}$")
"""What they name differently: ids made per call (uuid4 hex, NeMo Gym's ``resp_``/``msg_``/``rs_``)."""


def normalized(record: Any) -> Any:
    """A record with its timings as ``<time>`` (null stays null) and each generated id as
    ``<id N>``, N by first appearance in the record: equal for two runs of one scenario where
    only the clock and the ids differ, and still showing which references name the same call."""
    names: dict[str, str] = {}

    def walk(value: Any, key: str | None) -> Any:
        if isinstance(value, dict):
            return {k: walk(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, key) for v in value]
        if key in TIMING_KEYS and isinstance(value, (int, float)) and not isinstance(value, bool):
            return "<time>"
        if isinstance(value, str) and _GENERATED_ID.match(value):
            return names.setdefault(value, f"<id {len(names)}>")
        return value

    return walk(record, None)


def by_rollout(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records in rollout order (a collection writes them as they finish)."""
    return sorted(records, key=lambda r: (r.get("_ng_task_index"), r.get("_ng_rollout_index")))
