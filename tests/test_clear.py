"""``rollout_capture.clear``: the ids of the rollouts about to be dispatched, and their captures removed."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_capture import CaptureStore
from rollout_capture.clear import clear_model_call_captures_for_rollouts, rollout_ids_of


def test_ids_come_in_record_order_once_each_and_records_without_one_are_skipped() -> None:
    records = [
        {"_ng_task_index": 2, "_ng_rollout_index": 0},
        {"reward": 1.0},  # no id: nothing to clear
        {"_ng_task_index": 1, "_ng_rollout_index": 3},
        {"_ng_task_index": 2, "_ng_rollout_index": 0},
    ]
    assert rollout_ids_of(records) == ["2-0", "1-3"]


def test_a_bad_record_is_named_by_its_position() -> None:
    with pytest.raises(ValueError, match=r"record #1: invalid rollout id"):
        rollout_ids_of([{"_ng_task_index": 0, "_ng_rollout_index": 0}, {"_ng_rollout_id": "../etc"}])


def test_clearing_removes_the_named_rollouts_captures_in_every_dir_and_nothing_else(tmp_path: Path) -> None:
    stores = [CaptureStore(tmp_path / "a"), CaptureStore(tmp_path / "b")]
    for store in stores:
        for rollout_id in ("0-0", "0-1"):
            store.record(rollout_id, {"model_call_id": f"c-{rollout_id}", "kind": "model_call"})
    cleared = clear_model_call_captures_for_rollouts([{"_ng_task_index": 0, "_ng_rollout_index": 0}], stores)
    assert cleared == ["0-0"]
    for store in stores:
        assert store.read("0-0") == []
        assert [row["model_call_id"] for row in store.read("0-1")] == ["c-0-1"]


def test_one_bad_record_clears_nothing(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path / "caps")
    store.record("0-0", {"model_call_id": "c", "kind": "model_call"})
    records = [{"_ng_task_index": 0, "_ng_rollout_index": 0}, {"_ng_rollout_id": ""}]
    with pytest.raises(ValueError, match="record #1"):
        clear_model_call_captures_for_rollouts(records, [store])
    assert len(store.read("0-0")) == 1
