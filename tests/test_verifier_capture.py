"""Capture for verifiers, end to end with the real SDKs (issue 19.11).

A NeMo-Gym-style resources server answers ``POST /verify`` with a ``reward``; its verify handler
grades the rollout with a judge model, called with the openai SDK through the capture proxy.
The middleware mounted on the verifier server records one ``verifier_invocation`` row per verify
call; the attachment keeps NeMo Gym's ``metrics`` (every call, the judge's too) and tells the
policy's usage from the judge's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rollout_capture import CaptureRowError, CaptureStore, merge_model_call_capture_into_record
from rollout_capture.metrics import METRIC_FIELDS
from rollout_capture.producer import CaptureMiddleware, current_verifier_call
from rollout_capture.producer.proxy import CaptureProxy
from rollout_capture.producer.settings import ProxySettings
from rollout_capture.summation import exact_sum
from rollout_capture.whitespace_rows import read_whitespace_row, whitespace_line

from .support.producer_calls import API_KEY, sdk_call
from .support.scripted_upstream import CHAT
from .support.servers import ThreadedServer

POLICY = "policy"
VERIFIER = "math-verifier"
JUDGE_USAGE = CHAT["usage"]


class Deployment:
    """The capture proxy in front of the model server (policy and judge), and a verifier server
    with the middleware mounted, both writing into one capture root."""

    def __init__(self, upstream: str, root: Path) -> None:
        self.root = root
        self.proxy = ThreadedServer(
            CaptureProxy(ProxySettings(upstream=upstream, capture_dir=str(root), server_name=POLICY))
        )
        app = Starlette(routes=[Route("/verify", self.verify, methods=["POST"])])
        app.add_middleware(CaptureMiddleware, capture_dir=str(root), server_name=VERIFIER)
        self.verifier = ThreadedServer(app)
        self.headers_seen: list[str | None] = []

    async def verify(self, request: Request) -> JSONResponse:
        """A resources server's verify: ask a judge model, answer the request with a reward."""
        body = await request.json()
        call = current_verifier_call()  # the middleware says which rollout and invocation this is
        self.headers_seen.append(request.headers.get("x-rollout-capture-verifier-invocation-id"))
        if body.get("fail"):
            raise RuntimeError("the verifier failed")
        if call is None:  # not captured: graded without a judge
            return JSONResponse({**body, "reward": 0.0})
        judge = openai.AsyncOpenAI(
            base_url=call.base_url(self.proxy.url),
            api_key=API_KEY,
            default_headers=call.headers,
            max_retries=0,
            timeout=30,
        )
        async with judge:
            verdict = await judge.chat.completions.create(
                model="scripted", messages=[{"role": "user", "content": "Grade this answer."}]
            )
        graded = verdict.choices[0].message.tool_calls is not None
        return JSONResponse({**body, "reward": 1.0 if graded else 0.0})

    def stop(self) -> None:
        self.verifier.stop()
        self.proxy.stop()


@pytest.fixture
def deployment(scripted_upstream: tuple[str, Any], tmp_path: Path) -> Iterator[Deployment]:
    served = Deployment(scripted_upstream[0], tmp_path / "captures")
    yield served
    served.stop()


def merged(root: Path, task: int, rollout: int) -> dict[str, Any]:
    record = {"_ng_task_index": task, "_ng_rollout_index": rollout, "reward": 1.0}
    return merge_model_call_capture_into_record(record, [root])["ng_model_call_capture"]


def sums(calls: list[dict[str, Any]], field: str) -> Any:
    values = [c[field] for c in calls if c[field] is not None]
    return exact_sum(values) if values else None  # NeMo Gym's sum(), on any Python (issue 34)


def test_a_verify_call_and_its_judge_are_recorded_and_told_apart(deployment: Deployment) -> None:
    # The agent: policy calls through the proxy, then NeMo Gym's verify call (no prefix: the
    # rollout is named by the verify request, which carries the rollout's indices).
    sdk_call(deployment.proxy.url, "2-1", "chat", stream=False)
    sdk_call(deployment.proxy.url, "2-1", "messages", stream=True)
    verify = {"_ng_task_index": 2, "_ng_rollout_index": 1, "response": {"output": []}}
    answer = httpx.post(f"{deployment.verifier.url}/verify", json=verify, timeout=60)
    assert answer.status_code == 200 and answer.json()["reward"] == 1.0

    capture = merged(deployment.root, 2, 1)
    assert "gaps" not in capture
    calls = capture["calls"]
    assert [(c["dialect"], c["verifier_invocation_id"] is None) for c in calls] == [
        ("chat", True),
        ("messages", True),
        ("chat", False),
    ]
    judge = calls[2]
    (invocation,) = capture["verifier_invocations"]
    assert invocation["verifier_invocation_id"] == judge["verifier_invocation_id"]
    assert len(invocation["verifier_invocation_id"]) == 32  # generated: the call brought none
    assert deployment.headers_seen == [invocation["verifier_invocation_id"]]  # handed to the handler
    assert invocation["verifier_ref"] == {"type": "resources_servers", "name": VERIFIER}
    assert (invocation["status_code"], invocation["error_category"], invocation["reward"]) == (200, None, 1.0)
    assert invocation["latency_ms"] > 0 and invocation["started_at"] <= invocation["completed_at"]
    assert invocation["model_call_ids"] == [judge["model_call_id"]]
    assert (invocation["metrics"]["tokens_in"], invocation["metrics"]["num_calls"]) == (
        JUDGE_USAGE["prompt_tokens"],  # type: ignore[index]
        1,
    )

    # metrics as NeMo Gym computes them: every call, the judge's included.
    metrics = capture["metrics"]
    for field in METRIC_FIELDS:
        assert metrics[field] == sums(calls, field), field
    assert metrics["num_calls"] == 3
    # Beside them, whose tokens they are.
    owners = capture["metrics_by_owner"]
    assert owners["policy"]["tokens_in"] == sums(calls[:2], "tokens_in")
    assert owners["verifiers"]["tokens_in"] == JUDGE_USAGE["prompt_tokens"]  # type: ignore[index]
    assert (owners["policy"]["num_calls"], owners["verifiers"]["num_calls"]) == (2, 1)
    for field in ("tokens_in", "tokens_out", "tokens_total"):
        assert owners["policy"][field] + owners["verifiers"][field] == metrics[field]

    # NeMo Gym's reader counts every non-blank line of the JSONL file as a model call: the verify
    # call's row is a line of whitespace (which ours reads), so it counts 3 calls as we do; nothing
    # of the rollout lies beside the file NeMo Gym's clear deletes.
    lines = (deployment.root / "2-1.capture.jsonl").read_bytes().split(b"\n")
    assert [line.strip() == b"" for line in lines] == [False, False, False, True, True]
    assert read_whitespace_row(lines[3])["kind"] == "verifier_invocation"
    assert sorted(p.name for p in deployment.root.glob("2-1.*")) == ["2-1.capture.jsonl"]


def test_nemo_gyms_clear_leaves_no_verifier_evidence_behind(deployment: Deployment) -> None:
    """NeMo Gym's own clear deletes ``R.capture.jsonl`` and the marker, nothing else: the next
    rollout of that id must not find the verify calls of the last one (issue 34)."""
    sdk_call(deployment.proxy.url, "5-0", "chat", stream=False)
    verify = {"_ng_task_index": 5, "_ng_rollout_index": 0, "response": {"output": []}}
    assert httpx.post(f"{deployment.verifier.url}/verify", json=verify, timeout=60).status_code == 200
    assert len(merged(deployment.root, 5, 0)["verifier_invocations"]) == 1
    (deployment.root / "5-0.capture.jsonl").unlink()  # NeMo Gym's clear_model_call_captures_for_rollouts
    (deployment.root / "5-0.capture.incomplete").unlink(missing_ok=True)
    capture = merged(deployment.root, 5, 0)
    assert capture["calls"] == [] and "verifier_invocations" not in capture
    assert capture["gaps"] == [{"code": "model_call_capture_no_records"}]


def test_a_verify_call_under_the_prefix_keeps_its_id_and_a_failed_one_is_recorded(
    deployment: Deployment,
) -> None:
    base = f"{deployment.verifier.url}/ng-rollout/3-0/verify"
    given = {"X-Rollout-Capture-Verifier-Invocation-Id": "verify-3-0-first"}
    assert httpx.post(base, json={"response": {}}, headers=given, timeout=60).json()["reward"] == 1.0
    failed = httpx.post(
        base, json={"fail": True}, headers={"X-Rollout-Capture-Verifier-Invocation-Id": "v-2"}
    )
    assert failed.status_code == 500

    capture = merged(deployment.root, 3, 0)
    first, second = capture["verifier_invocations"]
    assert (first["verifier_invocation_id"], first["reward"], first["error_category"]) == (
        "verify-3-0-first",
        1.0,
        None,
    )
    assert len(first["model_call_ids"]) == 1
    assert (second["verifier_invocation_id"], second["status_code"], second["error_category"]) == (
        "v-2",
        None,
        "exception",
    )
    assert second["reward"] is None and second["model_call_ids"] == []
    assert second["metrics"]["num_calls"] == 0 and second["metrics"]["tokens_in"] is None
    # No policy call: the policy's usage is unknown (null), not zero.
    assert capture["metrics_by_owner"]["policy"] == {
        **capture["metrics_by_owner"]["policy"],
        "tokens_in": None,
    }
    rows = CaptureStore(deployment.root).read("3-0")
    assert [r.get("kind") for r in rows].count("verifier_invocation") == 2
    assert CaptureStore(deployment.root).claims(["3-0"]) == {}  # released, after the rows


def test_a_verify_call_naming_no_rollout_is_forwarded_uncaptured(deployment: Deployment) -> None:
    answer = httpx.post(f"{deployment.verifier.url}/verify", json={"response": {"id": "r"}}, timeout=60)
    assert answer.json() == {"response": {"id": "r"}, "reward": 0.0}  # the body reached it whole
    assert deployment.headers_seen == [None]
    assert not deployment.root.exists() or list(deployment.root.iterdir()) == []


def test_verifier_rows_an_older_producer_wrote_into_the_jsonl_file_still_read(tmp_path: Path) -> None:
    """Captures written before issue 34 hold the verify call's row among the model calls' lines:
    ours still reads it as the verifier invocation, and its judge call as the judge's."""
    judge = {"model_call_id": "j1", "dialect": "chat", "verifier_invocation_id": "v1", "response": CHAT}
    verify = {
        "kind": "verifier_invocation",
        "verifier_invocation_id": "v1",
        "reward": 0.5,
        "status_code": 200,
    }
    policy = {"model_call_id": "p1", "dialect": "chat", "response": CHAT}
    lines = b"".join(orjson.dumps(row) + b"\n" for row in (policy, judge, verify))
    (tmp_path / "4-0.capture.jsonl").write_bytes(lines)
    capture = merged(tmp_path, 4, 0)
    assert [c["model_call_id"] for c in capture["calls"]] == ["p1", "j1"] and "gaps" not in capture
    (invocation,) = capture["verifier_invocations"]
    assert (invocation["reward"], invocation["model_call_ids"]) == (0.5, ["j1"])


def test_verifier_rows_written_as_object_rows_beside_the_jsonl_file_still_read(tmp_path: Path) -> None:
    """Captures of the producers between issue 34 and its review fixes hold the verify call's row
    as an object row beside the JSONL file: ours still reads it."""
    judge = {"model_call_id": "j1", "dialect": "chat", "verifier_invocation_id": "v1", "response": CHAT}
    (tmp_path / "4-0.capture.jsonl").write_bytes(orjson.dumps(judge) + b"\n")
    (tmp_path / "4-0.capture").mkdir()
    verify = {"kind": "verifier_invocation", "verifier_invocation_id": "v1", "reward": 0.5}
    (tmp_path / "4-0.capture" / "000000000000.json").write_bytes(orjson.dumps(verify))
    capture = merged(tmp_path, 4, 0)
    assert [c["model_call_id"] for c in capture["calls"]] == ["j1"] and "gaps" not in capture
    (invocation,) = capture["verifier_invocations"]
    assert (invocation["reward"], invocation["model_call_ids"]) == (0.5, ["j1"])


def test_a_whitespace_row_takes_no_position_and_a_cut_one_is_damage(tmp_path: Path) -> None:
    """A whitespace row is read where it stands and takes no ``call_index`` (NeMo Gym's reader
    skips it: the calls after it keep NeMo Gym's indexes); one cut short by a failed write is a
    damaged row named by its line; any other blank line is no row."""
    verify = {"kind": "verifier_invocation", "verifier_invocation_id": "v1", "reward": 1.0}
    calls = [{"model_call_id": f"p{n}", "dialect": "chat", "response": CHAT} for n in range(3)]
    hidden = whitespace_line(verify)
    assert hidden.strip() == b"" and hidden.endswith(b"\n")
    lines = [orjson.dumps(calls[0]) + b"\n", hidden, b" \t \n", orjson.dumps(calls[1]) + b"\n"]
    lines += [hidden[: len(hidden) // 2] + b"\n", orjson.dumps(calls[2]) + b"\n"]
    (tmp_path / "6-0.capture.jsonl").write_bytes(b"".join(lines))
    capture = merged(tmp_path, 6, 0)
    assert [(c["model_call_id"], c["call_index"]) for c in capture["calls"]] == [
        ("p0", 0),
        ("p1", 1),
        ("p2", 2),
    ]
    (invocation,) = capture["verifier_invocations"]
    assert (invocation["verifier_invocation_id"], invocation["call_index"]) == ("v1", 1)
    detail = "count=1; 6-0.capture.jsonl:5: a whitespace row cut short"  # named: NeMo Gym skips it
    assert capture["gaps"] == [{"code": "model_call_capture_records_unreadable", "detail": detail}]
    with pytest.raises(CaptureRowError, match=r"6-0\.capture\.jsonl:5: a whitespace row"):
        CaptureStore(tmp_path).read("6-0")
