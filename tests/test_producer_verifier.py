"""``rollout_capture.producer.verifier``: a verify call's rollout and id, and the
``verifier_invocation`` row (contract 4) made of its request and answer, without a server."""

from __future__ import annotations

import logging
import re
from typing import Any

import orjson
import pytest

from rollout_capture.producer.verifier import (
    VERIFIER_HEADER_NAME,
    VerifierCall,
    VerifierExchange,
    current_verifier_call,
    new_invocation_id,
    reset_verifier_call,
    rollout_of_verify_body,
    set_verifier_call,
)


def test_a_verify_call_tells_its_judge_calls_where_and_as_whom_to_go() -> None:
    call = VerifierCall("3-1", "f" * 32)
    assert call.headers == {VERIFIER_HEADER_NAME: "f" * 32}
    assert call.base_url("http://proxy:8100/") == "http://proxy:8100/ng-rollout/3-1/v1"
    assert call.base_url("http://proxy:8100", v1=False) == "http://proxy:8100/ng-rollout/3-1"


def test_the_current_verify_call_is_set_around_a_handler_and_reset_after() -> None:
    assert current_verifier_call() is None
    token = set_verifier_call(VerifierCall("1-0", "id"))
    try:
        assert current_verifier_call() == VerifierCall("1-0", "id")
    finally:
        reset_verifier_call(token)
    assert current_verifier_call() is None


def test_the_rollout_of_a_verify_body_comes_from_its_indices() -> None:
    body = orjson.dumps({"_ng_task_index": 4, "_ng_rollout_index": 2, "response": {}})
    assert rollout_of_verify_body(body, whole=True) == "4-2"
    assert rollout_of_verify_body(body, whole=False) is None  # cut at the cap: not read
    assert rollout_of_verify_body(b"", whole=True) is None
    assert rollout_of_verify_body(b"not json", whole=True) is None
    assert rollout_of_verify_body(b"[1, 2]", whole=True) is None


def test_a_verify_body_naming_its_rollout_badly_is_logged_and_left_uncaptured(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="rollout_capture.producer"):
        assert rollout_of_verify_body(orjson.dumps({"_ng_rollout_id": "../x"}), whole=True) is None
    assert "forwarded uncaptured" in caplog.text


def test_invocation_ids_are_32_hex_digits_each_new() -> None:
    ids = {new_invocation_id() for _ in range(50)}
    assert len(ids) == 50 and all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)


def answered(
    request: bytes, answer: bytes, *, status: int = 200, server: str | None = "judge"
) -> dict[str, Any]:
    exchange = VerifierExchange("1-0", "inv-1", server_name=server, max_body_bytes=1000)
    assert exchange.prepare_request(request, whole=True) == request  # forwarded as it came
    exchange.forwarding()
    exchange.response_started(status, [(b"content-type", b"text/plain")])  # kept whatever its type
    exchange.body(answer)
    exchange.end()
    return exchange.row()


def test_the_row_carries_the_reward_its_answer_gives() -> None:
    row = answered(b'{"_ng_task_index": 1}', b'{"reward": 0.5, "extra": true}')
    assert row["kind"] == "verifier_invocation" and row["verifier_invocation_id"] == "inv-1"
    assert row["verifier_ref"] == {"type": "resources_servers", "name": "judge"}
    assert row["reward"] == 0.5 and row["response"] == {"reward": 0.5, "extra": True}
    assert row["request"] == {"_ng_task_index": 1} and row["status_code"] == 200
    assert row["error_category"] is None and row["completed_at"] >= row["started_at"]


@pytest.mark.parametrize("answer", [b'{"reward": true}', b'{"reward": "1"}', b'{"score": 1}', b"[1]"])
def test_a_reward_that_is_no_number_is_none(answer: bytes) -> None:
    assert answered(b"{}", answer)["reward"] is None


def test_an_unnamed_server_has_no_ref_and_a_failed_verify_its_category() -> None:
    row = answered(b"{}", b'{"detail": "boom"}', status=500, server=None)
    assert row["verifier_ref"] is None and row["status_code"] == 500
    assert row["error_category"] == "upstream_error" and row["reward"] is None


def test_a_request_over_the_cap_is_kept_cut_and_forwarded_whole() -> None:
    exchange = VerifierExchange("1-0", "inv-1", server_name=None, max_body_bytes=8)
    body = b'{"long": "' + b"x" * 50 + b'"}'
    assert exchange.prepare_request(body, whole=True) == body
    assert exchange.request_cut and exchange.request_raw == body[:8].decode()
