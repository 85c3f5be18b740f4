"""Rollout identity (spec 1) and the id as the only gate between user data and file names."""

from __future__ import annotations

import os
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_capture import (
    CaptureStore,
    clear_model_call_captures_for_rollouts,
    maybe_rollout_id_from_run_body,
    merge_model_call_capture_into_record,
    validate_rollout_id,
)
from rollout_capture.identity import MAX_ROLLOUT_ID_LENGTH, rollout_id_of

BAD_IDS = ["../x", "a/b", ".hidden", "a\\b", "a\x00b", "ä", "", "-lead", "x\n", "a b", "..", "/abs"]


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ({"_ng_task_index": 3, "_ng_rollout_index": 1}, "3-1"),
        ({"_ng_task_index": 3, "_ng_rollout_index": 1, "_ng_attempt_index": 2}, "3-1-a2"),
        ({"_ng_task_index": 3, "_ng_rollout_index": 1, "_ng_attempt_index": 0}, "3-1"),
        ({"_ng_task_index": 3, "_ng_rollout_index": 1, "_ng_attempt_index": "4"}, "3-1-a4"),
        ({"_ng_task_index": 3, "_ng_rollout_index": 1, "_ng_attempt_index": 2.0}, "3-1-a2"),
        ({"_ng_rollout_id": "run7.x_y", "_ng_task_index": 3, "_ng_rollout_index": 1}, "run7.x_y"),
        ({"_ng_rollout_id": "abc", "_ng_attempt_index": 1}, "abc-a1"),
        ({"_ng_rollout_id": None, "_ng_task_index": 0, "_ng_rollout_index": 0}, "0-0"),
        ({"_ng_task_index": 3}, None),
        ({"_ng_rollout_index": 3}, None),
        ({}, None),
    ],
)
def test_rollout_id_derivation(record: dict[str, object], expected: str | None) -> None:
    assert maybe_rollout_id_from_run_body(record) == expected


def test_non_mapping_has_no_id() -> None:
    assert maybe_rollout_id_from_run_body(None) is None
    assert maybe_rollout_id_from_run_body([1, 2]) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["../up", "a/b", 7, "", ".x"])
def test_malformed_explicit_id_is_an_error_not_rewritten(bad: object) -> None:
    with pytest.raises(ValueError, match="invalid rollout id"):
        maybe_rollout_id_from_run_body({"_ng_rollout_id": bad})


@pytest.mark.parametrize("attempt", ["two", 1.5, True, float("nan"), [1]])
def test_non_integer_attempt_is_a_value_error(attempt: object) -> None:
    with pytest.raises(ValueError, match="_ng_attempt_index"):
        maybe_rollout_id_from_run_body(
            {"_ng_task_index": 1, "_ng_rollout_index": 0, "_ng_attempt_index": attempt}
        )


@pytest.mark.parametrize("bad", BAD_IDS)
def test_unsafe_ids_are_rejected(bad: str) -> None:
    with pytest.raises(ValueError):
        validate_rollout_id(bad)


@pytest.mark.parametrize("good", ["0-0", "a", "A.b_c-9", "1-1-a1", "x.capture"])
def test_safe_ids_pass_unchanged(good: str) -> None:
    assert validate_rollout_id(good) == good


def _tree(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")}


@pytest.mark.parametrize("bad", BAD_IDS)
def test_no_store_operation_touches_anything_for_an_unsafe_id(tmp_path: Path, bad: str) -> None:
    outer = tmp_path / "outer"
    root = outer / "root"
    root.mkdir(parents=True)
    store = CaptureStore(root)
    before = _tree(outer)
    operations = [
        lambda: store.record(bad, {"model_call_id": "x"}),
        lambda: store.mark_incomplete(bad),
        lambda: store.is_incomplete(bad),
        lambda: store.has_any(bad),
        lambda: store.read(bad),
        lambda: store.read_available(bad),
        lambda: store.live_claims(bad),
        lambda: store.claim(bad).__enter__(),
        lambda: store.clear([bad]),
    ]
    for operation in operations:
        with pytest.raises(ValueError):
            operation()
    assert _tree(outer) == before
    assert os.listdir(tmp_path) == ["outer"]


def test_derived_ids_are_validated_before_any_deletion(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path)
    store.record("1-0", {"model_call_id": "a"})
    records = [
        {"_ng_task_index": 1, "_ng_rollout_index": 0},
        {"_ng_task_index": "../../etc", "_ng_rollout_index": 0},  # derives an unsafe id
    ]
    with pytest.raises(ValueError, match="record #1"):
        clear_model_call_captures_for_rollouts(records, [tmp_path])
    assert store.has_any("1-0")  # one bad record deleted nothing


def test_merge_with_unsafe_derived_id_raises_before_io(tmp_path: Path) -> None:
    record = {"_ng_task_index": "a/..", "_ng_rollout_index": 0}
    with pytest.raises(ValueError):
        merge_model_call_capture_into_record(record, [tmp_path])
    assert "ng_model_call_capture" not in record


def test_pydantic_run_request_with_extra_keys_has_an_id() -> None:
    """Agents receive run requests as ``extra="allow"`` pydantic models; NeMo Gym reads their keys."""
    from pydantic import BaseModel, ConfigDict

    class RunRequest(BaseModel):
        model_config = ConfigDict(extra="allow")
        responses_create_params: dict[str, object] = {}

    body = RunRequest.model_validate({"_ng_task_index": 5, "_ng_rollout_index": 2})
    assert maybe_rollout_id_from_run_body(body) == "5-2"
    retried = RunRequest.model_validate({"_ng_task_index": 5, "_ng_rollout_index": 2, "_ng_attempt_index": 1})
    assert maybe_rollout_id_from_run_body(retried) == "5-2-a1"
    assert maybe_rollout_id_from_run_body(RunRequest()) is None


indices = st.one_of(
    st.integers(-3, 10**6),
    st.integers(10 ** (MAX_ROLLOUT_ID_LENGTH // 2 - 2), 10 ** (MAX_ROLLOUT_ID_LENGTH // 2 + 2)),
    st.booleans(),
    st.floats(allow_nan=False),
    st.sampled_from(["4", "a/..", "x"]),
    st.none(),
)


def _outcome(record: Any) -> str | None:
    try:
        return rollout_id_of(record)
    except ValueError:
        return "refused"


@given(
    st.fixed_dictionaries(
        {},
        optional={
            "_ng_task_index": indices,
            "_ng_rollout_index": indices,
            "_ng_attempt_index": indices,
            "_ng_rollout_id": st.sampled_from([None, "run-1", "../x"]),
        },
    )
)
@settings(max_examples=500, deadline=None)
def test_the_fast_derivation_of_a_dict_equals_the_general_one(record: dict[str, Any]) -> None:
    """rollout_id_of's fast path (a dict of integer indices) against its reference, the general
    derivation and validation (taken by any other mapping)."""
    assert _outcome(record) == _outcome(MappingProxyType(record))
