"""NeMo Gym 0.7.0's projections (``ng_trajectory``, ``ng_perf``) rebuilt from our captures (issue 45).

The expected records are NeMo Gym's own: tests/data/nemo_gym_070_projections.json holds what
0.7.0's collection built for each case of tests/support/projection_cases.py, with its capture
("full") and with an empty one ("empty": a run whose captures went elsewhere, as NeMo Gym's
collection sees it when our producer writes to an object store). The NeMo Gym tier proves the
file is 0.7.0's (tests/test_nemo_gym_070.py). Enriching the "empty" record from the case's
capture must give the "full" one: the projection NeMo Gym would have built from those calls.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollout_capture import merge_model_call_capture_into_record
from rollout_capture.batch import enrich_lines

from .support.nemo_gym_compare import Tally, compare
from .support.projection_cases import cases

EXPECTED = Path(__file__).resolve().parent / "data" / "nemo_gym_070_projections.json"
BUILT = json.loads(EXPECTED.read_text())
INPUTS = {case["name"]: case for case in cases()}
NAMES = [case["name"] for case in BUILT["cases"]]


def _built(name: str) -> dict[str, Any]:
    return next(case for case in BUILT["cases"] if case["name"] == name)


def _capture(tmp_path: Path, name: str) -> Path:
    """The case's capture as NeMo Gym's model server wrote it (one JSONL file a rollout)."""
    root = tmp_path / "captures"
    root.mkdir()
    rows = INPUTS[name]["rows"]
    (root / "3-1.capture.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


def _differences(theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    tally = Tally()
    compare([theirs], [ours], tally)
    return tally.differences


def test_the_cases_are_what_nemo_gym_built_them_from() -> None:
    assert BUILT["nemo_gym"] == "0.7.0"
    assert list(INPUTS) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_a_record_collected_without_its_captures_gets_nemo_gyms_projection_of_ours(
    name: str, tmp_path: Path
) -> None:
    """The record NeMo Gym's collection left with an empty capture (0 model calls, coverage 0.0),
    enriched from the calls: ``ng_trajectory``, ``ng_perf`` and the attachment are what 0.7.0's
    collection builds from those calls, payloads in the trajectory as it keeps them."""
    built = _built(name)
    record = copy.deepcopy(built["empty"])
    merge_model_call_capture_into_record(record, [_capture(tmp_path, name)])
    assert _differences(built["full"], record) == []


@pytest.mark.parametrize("name", [name for name in NAMES if name != "projection_fails"])
def test_a_projection_of_our_calls_is_kept_as_it_is(name: str, tmp_path: Path) -> None:
    """Enriching a record whose projection was built from the same calls changes nothing, with
    its attachment (re-enrichment) or without it (NeMo Gym's attachment removed). (Where the
    projection failed, 0.7.0 left the payloads on the calls; a merge without payloads asked
    for, 0.7.0's or ours, leaves them out.)"""
    built = _built(name)
    capture = _capture(tmp_path, name)
    without = {key: value for key, value in built["full"].items() if key != "ng_model_call_capture"}
    for record in (copy.deepcopy(built["full"]), without):
        merge_model_call_capture_into_record(record, [capture])
        assert _differences(built["full"], record) == []


@pytest.mark.parametrize("name", NAMES)
def test_a_batch_rebuilds_the_projection_as_the_one_record_merge_does(name: str, tmp_path: Path) -> None:
    built = _built(name)
    capture = _capture(tmp_path, name)
    for payloads in (False, True):
        reference = merge_model_call_capture_into_record(
            copy.deepcopy(built["empty"]), [capture], include_payloads=payloads
        )
        batch = enrich_lines([orjson.dumps(built["empty"])], [capture], include_payloads=payloads)
        assert orjson.loads(batch.lines[0]) == reference
        if name not in ("multimodal_redacted", "projection_fails"):  # payloads in the trajectory alone
            assert all("request" not in call for call in reference["ng_model_call_capture"]["calls"])


def test_payloads_asked_for_stay_on_the_calls_of_a_record_without_a_projection(tmp_path: Path) -> None:
    capture = _capture(tmp_path, "capture_only")
    bare = {"_ng_task_index": 3, "_ng_rollout_index": 1}
    with_payloads = merge_model_call_capture_into_record(dict(bare), [capture], include_payloads=True)
    assert all("request" in call for call in with_payloads["ng_model_call_capture"]["calls"])
    assert "ng_trajectory" not in with_payloads  # none is made where NeMo Gym's collection left none
    without = merge_model_call_capture_into_record(dict(bare), [capture])
    assert all("request" not in call for call in without["ng_model_call_capture"]["calls"])


def test_a_projection_that_cannot_be_rebuilt_is_removed_with_a_gap_saying_why(tmp_path: Path) -> None:
    """NeMo Gym's projection refuses a call with a negative duration: the trajectory goes with its
    gap, as 0.7.0's collection leaves it; the ``ng_perf`` built from the empty capture goes too,
    ``ng_perf_unavailable`` saying why (ours), never a coverage of 0.0 beside our calls."""
    built = _built("projection_fails")
    record = merge_model_call_capture_into_record(
        copy.deepcopy(built["empty"]), [_capture(tmp_path, "projection_fails")]
    )
    assert "ng_trajectory" not in record and "ng_perf" not in record
    gaps = record["ng_model_call_capture"]["gaps"]
    assert {"code": "trajectory_projection_failed", "detail": "ValidationError"} in gaps
    assert {"code": "ng_perf_unavailable", "detail": "no ng_trajectory to build it from"} in gaps


def test_a_record_holding_ng_perf_alone_loses_it_with_a_gap(tmp_path: Path) -> None:
    stale = {
        "_ng_task_index": 3,
        "_ng_rollout_index": 1,
        "ng_perf": {"num_turns": 2, "token_observability_coverage": 0.0},
    }
    record = merge_model_call_capture_into_record(stale, [_capture(tmp_path, "capture_only")])
    assert "ng_perf" not in record
    assert {"code": "ng_perf_unavailable", "detail": "no ng_trajectory to build it from"} in record[
        "ng_model_call_capture"
    ]["gaps"]


def test_a_trajectory_that_is_not_an_object_is_removed_with_nemo_gyms_gap(tmp_path: Path) -> None:
    record = {"_ng_task_index": 3, "_ng_rollout_index": 1, "ng_trajectory": "stale"}
    merge_model_call_capture_into_record(record, [_capture(tmp_path, "capture_only")])
    assert "ng_trajectory" not in record
    assert {"code": "trajectory_projection_failed", "detail": "ValueError"} in record[
        "ng_model_call_capture"
    ]["gaps"]
