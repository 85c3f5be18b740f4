"""The merge's fast paths against the ways they stand in for (issue 18).

A JSONL capture read typed in one loop (damage and positions exactly as read the full
way, whether the whole buffer passed the UTF-8 check or not), and built attachments
folded into a summary without being looked over (the one-by-one count).
"""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_capture.attachment import build_attachment
from rollout_capture.call_records import BuiltCall
from rollout_capture.call_records_fast import typed_decode
from rollout_capture.evidence import Evidence
from rollout_capture.rows import add_jsonl
from rollout_capture.snapshot import RolloutSnapshot
from rollout_capture.summary import AttachmentFold, EvidenceSummary
from tests.test_call_records_fast import BASE, both_ways, row_lines

VERIFIER = {"kind": "verifier_invocation", "verifier_invocation_id": "v-1", "status_code": 200, "reward": 1}


def line(**changes: Any) -> bytes:
    return orjson.dumps({**BASE, **changes})


def typed_read(lines: list[bytes]) -> tuple[list[tuple[int, Any]], list[str]]:
    """``(rows, damage as "line: reason")`` of one JSONL buffer read for call records."""
    snap = RolloutSnapshot("r", found=True)
    add_jsonl(snap.parsed, b"\n".join(lines), "r.jsonl")
    rows, damaged = snap.record_rows(False)
    return rows, [f"{d.line}: {d.reason}" for d in damaged]


def gap_detail(lines: list[bytes]) -> Any:
    snap = RolloutSnapshot("r", found=True)
    add_jsonl(snap.parsed, b"\n".join(lines), "r.jsonl")
    gaps = build_attachment("r", Evidence(snap), now=0.0).get("gaps", [])
    return [gap.get("detail") for gap in gaps if gap["code"] == "model_call_capture_records_unreadable"]


def test_a_damaged_line_in_the_middle_of_a_checked_buffer_is_counted_and_keeps_positions() -> None:
    lines = [line(model_call_id="a"), b'{"torn": ', line(model_call_id="b"), orjson.dumps(VERIFIER)]
    rows, damage = typed_read(lines)
    assert damage == ["2: not JSON"]
    assert [position for position, _ in rows] == [0, 2, 3]  # the damaged line keeps its position
    assert [type(row) is BuiltCall for _, row in rows] == [True, True, False]
    assert rows[1][1].record["call_index"] == 2 and rows[1][1].record["model_call_id"] == "b"
    assert gap_detail(lines) == ["count=1"]
    full, typed, built = both_ways(lines)
    assert typed == full and built == 2


def test_invalid_utf8_in_a_skipped_field_mid_file_is_damage_as_the_full_way_says() -> None:
    """The whole buffer fails the UTF-8 check, so each line is checked alone: only the bad one
    is read the full way (orjson refuses it), the others stay typed."""
    bad = line(model_call_id="bad").replace(b'"content":"hi"', b'"content":"h\xffi"')
    assert b"\xff" in bad
    lines = [line(model_call_id="a"), bad, b"", line(model_call_id="c"), b'{"torn": ']
    rows, damage = typed_read(lines)
    assert damage == ["2: not JSON", "5: torn final line"]
    assert [position for position, _ in rows] == [0, 2]  # the blank line takes no position
    assert all(type(row) is BuiltCall for _, row in rows)
    assert gap_detail(lines) == ["count=2"]
    full, typed, built = both_ways(lines)
    assert typed == full and built == 2


def test_unreadable_tool_arguments_in_a_checked_buffer_fall_back_for_that_row_only() -> None:
    """msgspec reads the row (arguments kept raw) but orjson cannot read its arguments: that
    row is read the full way, which counts it as damage; the rows around it stay typed."""
    odd = line(model_call_id="odd").replace(b'"arguments":"{\\"a\\": 1}"', b'"arguments":1e400')
    assert b"1e400" in odd
    assert typed_decode(odd).response is not None  # the typed decoder takes the row itself
    lines = [line(model_call_id="a"), odd, line(model_call_id="c")]
    rows, damage = typed_read(lines)
    assert damage == ["2: not JSON"]
    assert [(position, type(row) is BuiltCall) for position, row in rows] == [(0, True), (2, True)]
    full, typed, _ = both_ways(lines)
    assert typed == full


def folded(attachments: list[dict[str, Any]], built: bool) -> str:
    summary = EvidenceSummary()
    if built:
        fold = AttachmentFold(summary)
        for attachment in attachments:
            fold.add_built_attachment(attachment)
        fold.flush()
    else:
        for attachment in attachments:
            summary.add_attachment(attachment)
    return repr(summary.model_dump())


@given(st.lists(st.lists(row_lines, max_size=5), min_size=1, max_size=6))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_built_attachments_fold_as_one_by_one(captures: list[list[bytes]]) -> None:
    attachments = []
    for index, lines in enumerate(captures):
        snap = RolloutSnapshot(f"r-{index}", found=True)
        add_jsonl(snap.parsed, b"\n".join(lines), "r.jsonl")
        attachments.append(build_attachment(f"r-{index}", Evidence(snap), now=0.0))
    assert folded(attachments, built=True) == folded(attachments, built=False)
