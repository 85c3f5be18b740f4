"""Merging (spec 7): one key added, gaps in order, idempotent, verifiers, the sample directory."""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from examples.samples import capture_rows, corpus_records, jsonl_bytes
from rollout_capture import CaptureStore, merge_model_call_capture_into_record
from rollout_capture.names import claim_name, jsonl_name, marker_name

from .conftest import SAMPLE

REF = {"type": "responses_api_models", "name": "m"}


def call_row(call_id: str, **extra: Any) -> dict[str, Any]:
    return {"model_call_id": call_id, "dialect": "chat", "model_ref": REF, "status_code": 200, **extra}


def record_for(rollout_id: str = "1-0") -> dict[str, Any]:
    task, rollout = rollout_id.split("-")[:2]
    return {"_ng_task_index": int(task), "_ng_rollout_index": int(rollout), "reward": 1.0}


def attachment(root: Path | list[Any], rollout_id: str = "1-0", **kwargs: Any) -> dict[str, Any]:
    dirs = root if isinstance(root, list) else [root]
    return merge_model_call_capture_into_record(record_for(rollout_id), dirs, **kwargs)[
        "ng_model_call_capture"
    ]


def write_claim(root: Path, rollout_id: str, claim_id: str, *, claimed_at: float, ttl_s: float) -> None:
    path = root / claim_name(rollout_id, claim_id)
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(
        orjson.dumps({"claim_id": claim_id, "host": "h", "pid": 1, "claimed_at": claimed_at, "ttl_s": ttl_s})
    )


def test_no_dirs_or_no_id_leaves_the_record_alone(tmp_path: Path) -> None:
    record = {"reward": 1}
    assert merge_model_call_capture_into_record(record, [tmp_path]) == {"reward": 1}
    with_id = record_for()
    assert merge_model_call_capture_into_record(with_id, []) == record_for()


def test_gap_order_covers_every_code(tmp_path: Path) -> None:
    assert attachment(tmp_path)["gaps"] == [{"code": "model_call_capture_no_records"}]

    (tmp_path / jsonl_name("2-0")).write_bytes(b"garbage\n")
    (tmp_path / marker_name("2-0")).write_bytes(b"")
    now = time.time()
    write_claim(tmp_path, "2-0", "live1", claimed_at=now, ttl_s=600)
    write_claim(tmp_path, "2-0", "old1", claimed_at=now - 1000, ttl_s=1)
    assert attachment(tmp_path, "2-0")["gaps"] == [
        {"code": "model_call_capture_records_unreadable", "detail": "count=1"},
        {"code": "model_call_capture_incomplete"},
        {"code": "model_call_capture_pending", "detail": "count=1"},
    ]

    write_claim(tmp_path, "3-0", "old2", claimed_at=now - 1000, ttl_s=1)
    write_claim(tmp_path, "3-0", "old3", claimed_at=now - 1000, ttl_s=1)
    assert attachment(tmp_path, "3-0")["gaps"] == [
        {"code": "model_call_capture_no_records"},
        {"code": "model_call_capture_claim_abandoned", "detail": "count=2"},
    ]


def test_store_that_cannot_be_read_is_a_gap_not_a_crash(tmp_path: Path) -> None:
    (tmp_path / jsonl_name("1-0")).mkdir()  # where a file should be
    result = attachment(tmp_path)
    assert result["gaps"] == [{"code": "model_call_capture_unreadable"}]
    assert result["calls"] == [] and result["metrics"]["num_calls"] == 0


def test_first_dir_holding_anything_is_used(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    CaptureStore(second).record("1-0", call_row("from-b"))
    assert [c["model_call_id"] for c in attachment([first, second])["calls"]] == ["from-b"]
    (first / marker_name("1-0")).write_bytes(b"")  # a marker alone makes the first dir the store
    result = attachment([first, second])
    assert result["calls"] == [] and result["gaps"] == [{"code": "model_call_capture_incomplete"}]


def test_merge_changes_no_other_key_and_is_idempotent(tmp_path: Path, corpus_dir: Path) -> None:
    records = corpus_records(corpus_dir)[:12]
    for index, original in enumerate(records):
        rollout_id = f"{index}-0"
        original = {**original, "_ng_task_index": index, "_ng_rollout_index": 0}
        CaptureStore(tmp_path).clear([rollout_id])
        rows = capture_rows(original, rollout_id, dialect=("responses", "chat", "messages")[index % 3])
        (tmp_path / jsonl_name(rollout_id)).write_bytes(jsonl_bytes(rows))
        record = copy.deepcopy(original)
        merge_model_call_capture_into_record(record, [tmp_path])
        assert set(record) == set(original) | {"ng_model_call_capture"}
        assert orjson.dumps(
            {k: v for k, v in record.items() if k != "ng_model_call_capture"}
        ) == orjson.dumps(original)
        once = orjson.dumps(record)
        merge_model_call_capture_into_record(record, [tmp_path])
        assert orjson.dumps(record) == once


def test_payloads_only_when_asked(tmp_path: Path) -> None:
    CaptureStore(tmp_path).record(
        "1-0", call_row("a", request={"messages": ["secret prompt"]}, response={"id": "r"})
    )
    lean = attachment(tmp_path)["calls"][0]
    assert (
        "request" not in lean
        and "response" not in lean
        and "secret prompt" not in orjson.dumps(lean).decode()
    )
    full = attachment(tmp_path, include_payloads=True)["calls"][0]
    assert full["request"] == {"messages": ["secret prompt"]} and full["response"] == {"id": "r"}


def test_verifier_invocations_last_one_wins_and_own_their_judge_calls(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path)
    verify = {"kind": "verifier_invocation", "verifier_ref": {"type": "resources_servers", "name": "judge"}}
    store.record("1-0", call_row("policy-1"))
    store.record("1-0", {**verify, "verifier_invocation_id": "v1", "reward": 0.0, "request": {"q": 1}})
    store.record("1-0", call_row("judge-1", verifier_invocation_id="v1"))
    store.record("1-0", {**verify, "verifier_invocation_id": "v1", "reward": 1.0, "status_code": 200})
    result = attachment(tmp_path)
    assert [c["model_call_id"] for c in result["calls"]] == ["policy-1", "judge-1"]
    assert result["metrics"]["num_calls"] == 2
    (invocation,) = result["verifier_invocations"]
    assert invocation == {
        "verifier_invocation_id": "v1",
        "call_index": 2,  # where its whitespace line stands: after two calls (it takes no index)
        "verifier_ref": {"type": "resources_servers", "name": "judge"},
        "started_at": None,
        "completed_at": None,
        "latency_ms": None,
        "status_code": 200,
        "error_category": None,
        "reward": 1.0,
        "model_call_ids": ["judge-1"],
        "metrics": {**result["metrics"], "num_calls": 1},  # its judge's calls only (issue 19.11)
    }
    assert list(result) == ["rollout_id", "metrics", "calls", "verifier_invocations", "metrics_by_owner"]


def test_sample_directory_attachments(tmp_path: Path) -> None:
    """The committed sample (NeMo Gym's local layout and the object layout) merges as expected."""
    gaps: dict[str, Any] = {}
    for raw in (SAMPLE / "rollouts.jsonl").read_bytes().splitlines():
        try:
            record = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue
        merge_model_call_capture_into_record(record, [SAMPLE / "captures"])
        if "ng_model_call_capture" in record:
            capture = record["ng_model_call_capture"]
            gaps[capture["rollout_id"]] = [g["code"] for g in capture.get("gaps", [])]
    assert gaps == {
        "0-0": [],
        "1-0": [],
        "2-0": [],
        "3-0": ["model_call_capture_records_unreadable"],
        "4-0": [],
        "5-0": [],
        "6-0": ["model_call_capture_incomplete"],
        "7-0": [],
        "8-0": ["model_call_capture_no_records"],
        "9-0-a1": [],
    }
    assert not any(name.startswith(".") for name in os.listdir(SAMPLE / "captures"))


@pytest.mark.parametrize("dialect", ["responses", "chat", "messages"])
def test_corpus_rows_in_every_dialect_give_tokens(tmp_path: Path, corpus_dir: Path, dialect: str) -> None:
    with_usage = [r for r in corpus_records(corpus_dir) if r["response"].get("usage")]
    for index, original in enumerate(with_usage[:8]):
        rollout_id = f"{index}-0"
        rows = capture_rows(original, rollout_id, dialect=dialect)  # type: ignore[arg-type]
        (tmp_path / jsonl_name(rollout_id)).write_bytes(jsonl_bytes(rows))
        result = attachment(tmp_path, rollout_id)
        usage = original["response"]["usage"]
        assert "gaps" not in result
        assert result["metrics"]["num_calls"] == len(rows)
        assert result["metrics"]["tokens_out"] == usage.get("output_tokens", usage.get("completion_tokens"))
        assert all(c["dialect"] == dialect for c in result["calls"])


def test_rollout_metrics_sum_what_calls_report_and_stay_null_when_none_does(tmp_path: Path) -> None:
    """Section 6: sums over the calls that report a value; null (unknown), never zero, when none does."""
    store = CaptureStore(tmp_path)
    store.record("1-0", call_row("a", latency_ms=100, response={"usage": {"prompt_tokens": 10}}))
    store.record(
        "1-0",
        call_row(
            "b",
            latency_ms=50.5,
            response={
                "usage": {
                    "prompt_tokens": 7,
                    "completion_tokens": 3,
                    "prompt_tokens_details": {"cached_tokens": 4},
                    "completion_tokens_details": {"reasoning_tokens": 2},
                }
            },
        ),
    )
    store.record("1-0", call_row("c", response={"usage": {"prompt_tokens": "12", "completion_tokens": -1}}))
    assert attachment(tmp_path)["metrics"] == {
        "tokens_in": 17,
        "tokens_out": 3,
        "tokens_reasoning": 2,
        "tokens_total": 10,  # only b knows both sides
        "cached_tokens": 4,
        "latency_total_ms": 150.5,
        "num_calls": 3,
    }
    store.record("2-0", call_row("d", response={"id": "r"}))
    assert attachment(tmp_path, "2-0")["metrics"] == {
        "tokens_in": None,
        "tokens_out": None,
        "tokens_reasoning": None,
        "tokens_total": None,
        "cached_tokens": None,
        "latency_total_ms": None,
        "num_calls": 1,
    }
