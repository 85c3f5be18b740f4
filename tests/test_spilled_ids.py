"""An input's rollout ids spilled to disk answer as they do in memory: the same repeated ids, in
the same order, with the same lines, and the same orphan captures (counted, named, matched)."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_capture.batch import BatchStats, DuplicateIds
from rollout_capture.summary import EvidenceSummary

IDS = st.sampled_from(["0-0", "0-1", "1-0", "1-0-a1", "1-0-a2", "2-0", "2-0-a1", "3-3", "10-0", "10-0-a3"])


def _batches(ids: list[list[str]]) -> list[BatchStats]:
    """Each batch's ``id_lines`` as the merge fills it: ids in their first line's order."""
    out, line = [], 1
    for batch in ids:
        id_lines: dict[str, list[int]] = {}
        for rollout_id in batch:
            id_lines.setdefault(rollout_id, []).append(line)
            line += 1
        out.append(BatchStats(id_lines=id_lines))
    return out


def _answers(ids: list[list[str]], listed: set[str], spill_after: int) -> tuple[object, ...]:
    tracker = DuplicateIds(spill_after=spill_after)
    try:
        for stats in _batches(ids):
            tracker.add(stats)
        reported = tracker.report(BatchStats(), "r.jsonl")
        evidence = EvidenceSummary()
        tracker.set_orphans(evidence, listed)
        return (
            reported.duplicate_id_lines,
            [(d.rollout_id, d.lines) for d in reported.duplicate_ids],
            evidence.orphan_captures,
            evidence.orphan_examples,
            evidence.orphan_near,
        )
    finally:
        tracker.close()


@settings(max_examples=150, deadline=None)
@given(
    ids=st.lists(st.lists(IDS, max_size=8), max_size=6),
    listed=st.sets(IDS | st.sampled_from(["4-0", "5-0-a1", "9-9"])),
    spill_after=st.integers(min_value=0, max_value=6),
)
def test_spilled_ids_answer_as_in_memory(ids: list[list[str]], listed: set[str], spill_after: int) -> None:
    assert _answers(ids, listed, spill_after) == _answers(ids, listed, 10**9)


def test_spilled_ids_leave_nothing_on_disk(tmp_path: object) -> None:
    tracker = DuplicateIds(spill_after=1)
    for stats in _batches([["0-0", "1-0"], ["0-0", "2-0"]]):
        tracker.add(stats)
    spilled = tracker._spilled
    assert spilled is not None and os.path.isdir(spilled._folder)
    assert tracker.report(BatchStats(), "r.jsonl").duplicate_id_lines == 1
    tracker.close()
    assert not os.path.exists(spilled._folder)
