"""Batch enrichment (the flows' unit of work): order, pass-through, byte preservation, waiting."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollout_capture import CaptureStore, merge_model_call_capture_into_record
from rollout_capture.batch import BatchStats, enrich_lines, splice_attachment

from .conftest import S3, Clock

ROW = {
    "model_call_id": "c",
    "dialect": "chat",
    "response": {"usage": {"prompt_tokens": 5, "completion_tokens": 2}},
}


def lines_for(records: list[Any]) -> list[bytes]:
    return [r if isinstance(r, bytes) else orjson.dumps(r) for r in records]


def test_output_keeps_order_and_count_and_reports_bad_lines(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path)
    store.record("1-0", ROW)
    lines = lines_for(
        [
            {"_ng_task_index": 1, "_ng_rollout_index": 0},
            b"<PLACEHOLDER ROW>",
            b"",
            b"[1, 2]",
            {"_ng_rollout_id": "../escape"},
            {"no": "id"},
            {"_ng_task_index": 2, "_ng_rollout_index": 0},
        ]
    )
    batch = enrich_lines(lines, [store], first_line=11)
    assert len(batch.lines) == len(lines)
    assert batch.lines[1:6] == lines[1:6]  # passed through unchanged
    first, last = orjson.loads(batch.lines[0]), orjson.loads(batch.lines[6])
    assert first["ng_model_call_capture"]["metrics"]["tokens_in"] == 5
    assert last["ng_model_call_capture"]["gaps"] == [{"code": "model_call_capture_no_records"}]
    problems = [(p.line, p.reason) for p in batch.stats.problems]
    assert [line for line, _ in problems] == [12, 14, 15]
    assert problems[0][1].startswith("not JSON (") and problems[1][1] == "not a JSON object (list)"
    assert problems[2][1].startswith("invalid rollout id '../escape'")
    assert batch.stats.model_dump(exclude={"problems"}) == {
        "lines": 7,
        "rollouts": 2,
        "calls": 1,
        "tokens_in": 5,
        "tokens_out": 2,
        "tokens_total": 7,
        "waited_for": 0,
        "rollouts_with_gaps": 1,
        "gaps": {"model_call_capture_no_records": 1},
        "duplicate_id_lines": 0,
        "duplicate_ids": [],
    }


def test_splice_keeps_every_original_byte(tmp_path: Path) -> None:
    CaptureStore(tmp_path).record("1-0", ROW)
    original = b'{"_ng_task_index": 1, "_ng_rollout_index": 0, "x": 1.50, "s": "\\u00e9"  }  \n'
    (out,) = enrich_lines([original], [tmp_path]).lines
    assert out.startswith(b'{"_ng_task_index": 1, "_ng_rollout_index": 0, "x": 1.50, "s": "\\u00e9",')
    record = orjson.loads(out)
    expected = merge_model_call_capture_into_record(orjson.loads(original), [tmp_path])
    assert record == expected
    assert splice_attachment(b"{}", {"a": 1}) == b'{"ng_model_call_capture":{"a":1}}'


def test_records_with_observations_or_an_old_attachment_are_merged_in_full(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path)
    store.record("1-0", ROW)
    observed = {
        "_ng_task_index": 1,
        "_ng_rollout_index": 0,
        "ng_agent_observations": {"source": "h", "invocations": [{"invocation_id": "a", "model_calls": []}]},
    }
    stale = {"_ng_task_index": 1, "_ng_rollout_index": 0, "ng_model_call_capture": {"old": True}}
    out = enrich_lines(lines_for([observed, stale]), [store]).lines
    got_observed, got_stale = (orjson.loads(x) for x in out)
    assert got_observed["ng_agent_observations"]["gaps"] == [
        {"code": "model_call_ownership_unavailable", "detail": "capture:c:call_index=0"}
    ]
    assert list(got_stale) == ["_ng_task_index", "_ng_rollout_index", "ng_model_call_capture"]
    assert "old" not in got_stale["ng_model_call_capture"]
    again = enrich_lines(out, [store]).lines  # enriching enriched output changes nothing
    assert [orjson.loads(x) for x in again] == [got_observed, got_stale]


def test_only_claimed_rollouts_are_waited_for(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path)
    for task in range(5):
        store.record(f"{task}-0", ROW)
    claim = store.claim("3-0")
    claim.__enter__()
    asked: list[set[str]] = []

    def waiter(pending: set[str]) -> set[str]:
        asked.append(set(pending))
        store.record("3-0", {**ROW, "model_call_id": "late"})  # the late row lands...
        claim.__exit__(None, None, None)  # ...then its claim goes
        return set()

    lines = lines_for([{"_ng_task_index": t, "_ng_rollout_index": 0} for t in range(5)])
    batch = enrich_lines(lines, [store], waiter=waiter)
    assert asked == [{"3-0"}]
    assert batch.stats.waited_for == 1
    late = orjson.loads(batch.lines[3])["ng_model_call_capture"]
    assert [c["model_call_id"] for c in late["calls"]] == ["c", "late"]
    assert "gaps" not in late


def test_a_claim_outliving_the_deadline_is_reported_pending(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path)
    with store.claim("1-0"):
        batch = enrich_lines(
            lines_for([{"_ng_task_index": 1, "_ng_rollout_index": 0}]), [store], quiescence_timeout_s=0.1
        )
    assert batch.stats.gaps == {"model_call_capture_no_records": 1, "model_call_capture_pending": 1}


@pytest.mark.parametrize("rollouts", [3, 60])
def test_object_store_batch_matches_local(tmp_path: Path, s3: S3, rollouts: int) -> None:
    local = CaptureStore(tmp_path)
    remote = CaptureStore(s3.url("caps"), storage_options=s3.storage_options)
    for task in range(rollouts):
        for n in range(task % 3):
            row = {**ROW, "model_call_id": f"c{task}-{n}"}
            local.record(f"{task}-0", row)
            remote.record(f"{task}-0", row)
    remote.mark_incomplete("1-0")
    local.mark_incomplete("1-0")
    lines = lines_for([{"_ng_task_index": t, "_ng_rollout_index": 0} for t in range(rollouts)])
    assert enrich_lines(lines, [remote]).lines == enrich_lines(lines, [local]).lines


def test_stats_add_up() -> None:
    a = BatchStats(lines=2, rollouts=1, rollouts_with_gaps=1, gaps={"x": 1})
    b = BatchStats(lines=3, rollouts=2, rollouts_with_gaps=1, gaps={"x": 2, "y": 1}, waited_for=1)
    assert (a + b).model_dump() == {
        "lines": 5,
        "rollouts": 3,
        "calls": 0,
        "tokens_in": None,  # no call reported any: unknown, never 0
        "tokens_out": None,
        "tokens_total": None,
        "waited_for": 1,
        "rollouts_with_gaps": 2,
        "gaps": {"x": 3, "y": 1},
        "problems": [],
        "duplicate_id_lines": 0,
        "duplicate_ids": [],
    }
    assert (a + b).gap_share == 2 / 3 and BatchStats().gap_share == 0.0


def test_no_capture_dirs_passes_everything_through() -> None:
    lines = [b'{"_ng_task_index": 1, "_ng_rollout_index": 0}\n', b"junk\n"]
    assert enrich_lines(lines, []).lines == [lines[0][:-1], b"junk"]


def test_expired_claims_do_not_cause_a_wait(tmp_path: Path, clock: Clock) -> None:
    store = CaptureStore(tmp_path)
    clock.set(time.time() - 60)  # made a minute ago...
    claim = store.claim("1-0", ttl_s=30)
    claim.__enter__()
    clock.set(time.time())  # ...so its 30 s ran out half a minute ago

    def never(pending: set[str]) -> set[str]:
        raise AssertionError(f"waited for {pending}")

    batch = enrich_lines(lines_for([{"_ng_task_index": 1, "_ng_rollout_index": 0}]), [store], waiter=never)
    assert batch.stats.gaps["model_call_capture_claim_abandoned"] == 1
