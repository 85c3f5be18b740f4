"""Ownership join (spec 8): identity-only matching, explicit gaps, idempotent re-merge."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from rollout_capture import CaptureStore, merge_model_call_capture_into_record

POLICY = {"type": "responses_api_models", "name": "policy"}
OTHER = {"type": "responses_api_models", "name": "other"}


def call(call_id: str, response_id: str, ref: dict[str, str] = POLICY, **extra: Any) -> dict[str, Any]:
    return {
        "model_call_id": call_id,
        "dialect": "responses",
        "model_ref": ref,
        "response": {"id": response_id},
        **extra,
    }


@pytest.fixture
def root(tmp_path: Path) -> Path:
    store = CaptureStore(tmp_path)
    for row in [
        call("c0", "r0"),
        call("c1", "r1"),
        call("c2", "dup"),
        call("c3", "dup"),
        call("c4", "r4", OTHER),
        call("j0", "judge", verifier_invocation_id="v1"),
    ]:
        store.record("1-0", row)
    return tmp_path


def merged(root: Path, observations: dict[str, Any]) -> dict[str, Any]:
    record = {"_ng_task_index": 1, "_ng_rollout_index": 0, "ng_agent_observations": observations}
    return merge_model_call_capture_into_record(record, [root])


def test_refs_resolve_by_identity_and_every_doubt_is_a_gap(root: Path) -> None:
    observations = {
        "source": "harness",
        "invocations": [
            {
                "invocation_id": "main",
                "model_calls": [{"model_call_id": "c0"}, {"model_ref": POLICY, "response_id": "r1"}],
            },
            {
                "invocation_id": "sub",
                "model_calls": [
                    {"model_ref": POLICY, "response_id": "dup"},  # two calls answer: ambiguous
                    {"model_call_id": "c0"},  # already owned by main: conflict
                    {"model_call_id": "c4", "response_id": "wrong"},  # disagrees with the call: unmatched
                    {"model_call_id": "nope"},
                ],
            },
        ],
        "gaps": [{"code": "harness_lost_a_turn", "invocation_id": "sub"}],
    }
    result = merged(root, copy.deepcopy(observations))["ng_agent_observations"]
    main, sub = result["invocations"]
    assert main["model_calls"] == [
        {"model_call_id": "c0", "model_ref": POLICY, "response_id": "r0"},
        {"model_call_id": "c1", "model_ref": POLICY, "response_id": "r1"},
    ]
    assert (
        sub["model_calls"] == observations["invocations"][1]["model_calls"]
    )  # unresolved refs stay as they were
    assert result["gaps"] == [
        {"code": "harness_lost_a_turn", "invocation_id": "sub"},
        {"code": "model_call_reference_ambiguous", "invocation_id": "sub", "detail": "dup"},
        {"code": "model_call_reference_conflict", "invocation_id": "sub", "detail": "c0"},
        {"code": "model_call_reference_unmatched", "invocation_id": "sub", "detail": "c4"},
        {"code": "model_call_reference_unmatched", "invocation_id": "sub", "detail": "nope"},
        {"code": "model_call_ownership_unavailable", "detail": "capture:c2:call_index=2"},
        {"code": "model_call_ownership_unavailable", "detail": "capture:c3:call_index=3"},
        {"code": "model_call_ownership_unavailable", "detail": "capture:c4:call_index=4"},
    ]  # the judge call j0 belongs to its verifier, so it is not unowned
    assert result["source"] == "harness"


def test_rejoin_is_idempotent_and_drops_only_its_own_gaps(root: Path) -> None:
    observations = {
        "source": "h",
        "invocations": [{"invocation_id": "main", "model_calls": [{"model_call_id": "c1"}]}],
        "gaps": [
            {"code": "model_call_reference_unmatched", "invocation_id": "main", "detail": "stale"},
            {"code": "model_call_ownership_unavailable", "detail": "capture:gone:call_index=9"},
            {
                "code": "model_call_ownership_unavailable",
                "invocation_id": "main",
                "detail": "harness said so",
            },
        ],
    }
    record = merged(root, observations)
    first = copy.deepcopy(record)
    merge_model_call_capture_into_record(record, [root])
    assert record == first
    gaps = record["ng_agent_observations"]["gaps"]
    assert {
        "code": "model_call_ownership_unavailable",
        "invocation_id": "main",
        "detail": "harness said so",
    } in gaps
    assert not any(g.get("detail") in ("stale", "capture:gone:call_index=9") for g in gaps)
    assert len(gaps) == len({(g["code"], g.get("invocation_id"), g.get("detail")) for g in gaps})


@pytest.mark.parametrize(
    "observations",
    [
        "not an object",
        {"source": "h", "invocations": [{"invocation_id": "a", "model_calls": [{"response_id": "r0"}]}]},
        {"source": "h", "invocations": [{"invocation_id": "a"}, {"invocation_id": "a"}]},
        {"source": "h", "invocations": [{"model_calls": []}]},
        {"source": "h", "invocations": [], "gaps": "x"},
        {"source": "h", "invocations": [{"invocation_id": "a", "model_calls": [{"model_call_id": 5}]}]},
    ],
)
def test_malformed_observations_become_a_gap_and_stay_untouched(root: Path, observations: Any) -> None:
    record = merged(root, copy.deepcopy(observations))
    assert record["ng_agent_observations"] == observations
    assert record["ng_model_call_capture"]["gaps"] == [{"code": "agent_observation_join_failed"}]


def test_nemo_gym_typed_records_shape_is_joined_too(root: Path) -> None:
    observations = {
        "source": "claude_code",
        "records": [
            {"kind": "agent_invocation", "invocation_id": "root", "model_calls": [{"model_call_id": "c0"}]},
            {"kind": "tool_call", "invocation_id": "root", "tool_call_id": "t1"},
        ],
        "gaps": [],
    }
    result = merged(root, copy.deepcopy(observations))["ng_agent_observations"]
    assert result["records"][0]["model_calls"] == [
        {"model_call_id": "c0", "model_ref": POLICY, "response_id": "r0"}
    ]
    assert result["records"][1] == {"kind": "tool_call", "invocation_id": "root", "tool_call_id": "t1"}


def test_a_foreign_ownership_gap_is_kept(root: Path) -> None:
    """Section 8: the join drops only the gaps it wrote (no invocation, a ``capture:`` detail)."""
    foreign = [
        {"code": "model_call_ownership_unavailable"},
        {"code": "model_call_ownership_unavailable", "detail": "harness lost its trace"},
    ]
    observations = {"source": "h", "invocations": [], "gaps": copy.deepcopy(foreign)}
    record = merged(root, observations)
    gaps = record["ng_agent_observations"]["gaps"]
    assert gaps[:2] == foreign
    assert {"code": "model_call_ownership_unavailable", "detail": "capture:c0:call_index=0"} in gaps
    merge_model_call_capture_into_record(record, [root])  # a second join keeps them too
    assert record["ng_agent_observations"]["gaps"] == gaps


def test_an_earlier_runs_capture_gap_of_any_detail_is_dropped_as_nemo_gym_does(root: Path) -> None:
    """NeMo Gym's rule: before recomputing, drop ownership gaps with no invocation whose detail
    starts with ``capture:`` (the join's own, whatever their shape); keep every other one."""
    kept = [
        {"code": "model_call_ownership_unavailable"},
        {"code": "model_call_ownership_unavailable", "detail": "direct_provider"},
        {"code": "model_call_ownership_unavailable", "invocation_id": "main", "detail": "capture:x"},
    ]
    stale = {"code": "model_call_ownership_unavailable", "detail": "capture:stale"}
    observations = {"source": "h", "invocations": [], "gaps": [stale, *copy.deepcopy(kept)]}
    gaps = merged(root, observations)["ng_agent_observations"]["gaps"]
    assert stale not in gaps
    assert gaps[:3] == kept
    assert {"code": "model_call_ownership_unavailable", "detail": "capture:c0:call_index=0"} in gaps
