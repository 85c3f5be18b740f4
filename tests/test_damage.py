"""Damaged rows (spec 2, 7): counted, never hiding the others, with stable call indexes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from rollout_capture import (
    CaptureRowError,
    CaptureStore,
    merge_model_call_capture_into_record,
    read_available_model_call_records,
    read_model_call_records,
)
from rollout_capture.names import jsonl_name, object_name


def row(call_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "model_call_id": call_id,
        "dialect": "responses",
        "model_ref": {"type": "responses_api_models", "name": "m"},
        "status_code": 200,
        "response": {"id": f"r-{call_id}", "usage": {"input_tokens": 2, "output_tokens": 1}},
        **extra,
    }


def line(value: Any) -> bytes:
    return orjson.dumps(value) + b"\n"


def merge(root: Path, rollout_id: str = "1-0") -> dict[str, Any]:
    task, rollout = rollout_id.split("-")
    record = {"_ng_task_index": int(task), "_ng_rollout_index": int(rollout)}
    return merge_model_call_capture_into_record(record, [root])["ng_model_call_capture"]


def test_torn_final_line_is_counted_and_the_rest_kept(tmp_path: Path) -> None:
    data = line(row("a")) + b"\n  \n" + line(row("b")) + b'{"model_call_id": "c", "dia'
    (tmp_path / jsonl_name("1-0")).write_bytes(data)
    attachment = merge(tmp_path)
    assert [c["model_call_id"] for c in attachment["calls"]] == ["a", "b"]
    assert [c["call_index"] for c in attachment["calls"]] == [0, 1]  # blank lines take no position
    assert attachment["gaps"] == [{"code": "model_call_capture_records_unreadable", "detail": "count=1"}]
    assert attachment["metrics"]["num_calls"] == 2 and attachment["metrics"]["tokens_in"] == 4


def test_non_object_rows_and_invalid_fields_keep_indexes_stable(tmp_path: Path) -> None:
    data = (
        line(row("a"))
        + line([1, 2])
        + line("text")
        + b"not json at all\n"
        + line(row("bad", model_ref={"type": "wrong", "name": "x"}))
        + line(row("bad2", started_at="noon"))
        + line(row("z"))
    )
    (tmp_path / jsonl_name("1-0")).write_bytes(data)
    attachment = merge(tmp_path)
    assert [(c["model_call_id"], c["call_index"]) for c in attachment["calls"]] == [("a", 0), ("z", 6)]
    assert attachment["gaps"] == [{"code": "model_call_capture_records_unreadable", "detail": "count=5"}]
    calls, damaged = read_available_model_call_records(tmp_path, "1-0")
    assert [c.call_index for c in calls] == [0, 6] and damaged == 5


def test_object_layout_damage_empty_and_non_object_files(tmp_path: Path) -> None:
    bodies = [orjson.dumps(row("a")), b"", b"   ", b"[1]", b"{broken", orjson.dumps(row("f"))]
    for seq, body in enumerate(bodies):
        path = tmp_path / object_name("1-0", seq)
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(body)
    store = CaptureStore(tmp_path)
    rows, damaged = store.read_available("1-0")
    assert [(i, r["model_call_id"]) for i, r in rows] == [(0, "a"), (5, "f")]
    assert damaged == 4


def test_jsonl_rows_come_before_object_rows(tmp_path: Path) -> None:
    (tmp_path / jsonl_name("1-0")).write_bytes(line(row("j0")) + line(row("j1")))
    for seq, name in enumerate(["o0", "o1"]):
        path = tmp_path / object_name("1-0", seq)
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(orjson.dumps(row(name)))
    attachment = merge(tmp_path)
    assert [(c["model_call_id"], c["call_index"]) for c in attachment["calls"]] == [
        ("j0", 0),
        ("j1", 1),
        ("o0", 2),
        ("o1", 3),
    ]


def test_strict_readers_name_file_and_line(tmp_path: Path) -> None:
    (tmp_path / jsonl_name("1-0")).write_bytes(line(row("a")) + b"\n" + b"oops\n" + line(row("b")))
    store = CaptureStore(tmp_path)
    with pytest.raises(CaptureRowError) as caught:
        store.read("1-0")
    assert caught.value.damage.line == 3
    assert str(caught.value).startswith(str(tmp_path / jsonl_name("1-0")) + ":3: not JSON")
    with pytest.raises(CaptureRowError, match=":3:"):
        read_model_call_records(tmp_path, "1-0")


def test_real_bad_rows_from_the_corpus(tmp_path: Path, corpus_dir: Path) -> None:
    """Lines of a real rollouts file (with its <PLACEHOLDER ROW> lines) used as capture rows."""
    raw = (corpus_dir / "resources_servers__tavily_search.jsonl").read_bytes()
    lines = raw.splitlines()
    bad = sum(1 for x in lines if x.startswith(b"<PLACEHOLDER"))
    assert bad == 5
    (tmp_path / jsonl_name("1-0")).write_bytes(raw)
    attachment = merge(tmp_path)
    assert attachment["gaps"][0] == {
        "code": "model_call_capture_records_unreadable",
        "detail": f"count={bad}",
    }
    assert len(attachment["calls"]) == len(lines) - bad
    assert [c["call_index"] for c in attachment["calls"]] == [
        i for i, x in enumerate(lines) if not x.startswith(b"<PLACEHOLDER")
    ]


def test_unknown_row_kind_is_reported_not_silently_dropped(tmp_path: Path) -> None:
    (tmp_path / jsonl_name("1-0")).write_bytes(line(row("a")) + line({"kind": "from_the_future"}))
    attachment = merge(tmp_path)
    assert attachment["gaps"] == [{"code": "model_call_capture_records_unreadable", "detail": "count=1"}]
