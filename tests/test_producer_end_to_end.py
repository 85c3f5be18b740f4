"""A NeMo-Gym-style run through the capture proxy, then ``enrich_rollouts`` over what it wrote:
call records, tokens, TTFT and gaps as the scripted model said; a call still streaming is
awaited; the attachment equals the one NeMo Gym's reader makes of the same rows written
directly with ``CaptureStore.record``."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from rollout_capture import (
    CaptureStore,
    await_model_call_capture_quiescence,
    merge_model_call_capture_into_record,
)
from rollout_capture.flows import enrich_rollouts
from rollout_capture.producer.proxy import CaptureProxy
from rollout_capture.producer.settings import ProxySettings

from .conftest import wait_for
from .support.producer_calls import PLAIN, derived, openai_client, sdk_call
from .support.servers import ThreadedServer

pytestmark = pytest.mark.usefixtures("prefect_api")
SERVER = "policy"
VERIFIER = "verify-0"


@pytest.fixture(scope="module")
def proxied(
    scripted_upstream: tuple[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    root = tmp_path_factory.mktemp("e2e-captures")
    settings = ProxySettings(upstream=scripted_upstream[0], capture_dir=str(root), server_name=SERVER)
    server = ThreadedServer(CaptureProxy(settings))
    yield server.url, root
    server.stop()


def agent(base: str, rollout_id: str) -> None:
    """What an agent harness and its verifier do for one rollout: calls in all three dialects."""
    sdk_call(base, rollout_id, "chat", stream=False)
    sdk_call(base, rollout_id, "chat", stream=True)
    sdk_call(base, rollout_id, "responses", stream=True)
    sdk_call(base, rollout_id, "messages", stream=True)
    judge = openai_client(
        base, rollout_id, default_headers={"X-Rollout-Capture-Verifier-Invocation-Id": VERIFIER}
    )
    judge.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "grade it"}])


def write_rollouts(path: Path, ids: list[str]) -> None:
    lines = []
    for rollout_id in ids:
        task, index = rollout_id.split("-")
        lines.append(
            orjson.dumps({"_ng_task_index": int(task), "_ng_rollout_index": int(index), "reward": 1.0})
        )
    path.write_bytes(b"\n".join(lines) + b"\n")


def test_a_proxied_run_enriches_as_nemo_gyms_reader_would(
    proxied: tuple[str, Path], scripted_upstream: tuple[str, Any], tmp_path: Path
) -> None:
    base, root = proxied
    gate = scripted_upstream[1].gate("e2e")
    store = CaptureStore(root)
    agent(base, "0-0")
    # The verifier's own row (written by the resources server, not by a model server).
    store.record(
        "0-0",
        {
            "kind": "verifier_invocation",
            "verifier_invocation_id": VERIFIER,
            "reward": 1.0,
            "status_code": 200,
        },
    )
    list(openai_client(base, "1-0").chat.completions.create(model="scripted-cut", messages=[], stream=True))
    with pytest.raises(openai.RateLimitError):
        openai_client(base, "1-0").chat.completions.create(model="scripted-429", messages=[])
    # 2-0 makes no call. 3-0 is still streaming when enrichment starts.
    streaming = threading.Thread(
        target=lambda: httpx.post(
            f"{base}/ng-rollout/3-0/v1/chat/completions",
            json={"model": "scripted-gated-e2e", "messages": [], "stream": True},
            timeout=60,
        )
    )
    streaming.start()
    wait_for(lambda: store.live_claims("3-0"), 15, "the streaming call's claim")
    assert store.read("3-0") == []  # the upstream waits at its gate; it opens while the flow runs
    threading.Timer(1.5, gate.set).start()
    rollouts = tmp_path / "rollouts.jsonl"
    write_rollouts(rollouts, ["0-0", "1-0", "2-0", "3-0"])

    summary = enrich_rollouts(str(rollouts), str(root), quiescence_timeout_s=60)
    streaming.join(60)

    out = {
        f"{r['_ng_task_index']}-{r['_ng_rollout_index']}": r["ng_model_call_capture"]
        for r in map(orjson.loads, Path(summary.output).read_bytes().splitlines())
    }
    run = out["0-0"]
    calls = run["calls"]
    assert [c["dialect"] for c in calls] == ["chat", "chat", "responses", "messages", "chat"]
    for call, dialect in zip(calls, ["chat", "chat", "responses", "messages", "chat"], strict=True):
        forwarded = {"upstream_attempted": True, "response_source": "upstream", "upstream_status_code": None}
        expected = derived({"response": PLAIN[dialect], "dialect": dialect, "status_code": 200, **forwarded})
        got = {
            k: v
            for k, v in call.items()
            if k in expected and k not in ("model_ref", "verifier_invocation_id", "call_index")
        }
        assert got == {k: v for k, v in expected.items() if k in got}
        assert call["model_ref"] == {"type": "responses_api_models", "name": SERVER}
        assert (
            call["latency_ttft_ms"] is not None and 0 <= call["latency_ttft_ms"] <= call["latency_total_ms"]
        )
    metrics = run["metrics"]
    assert metrics["num_calls"] == 5
    assert (metrics["tokens_in"], metrics["tokens_out"], metrics["tokens_total"]) == (820, 175, 995)
    assert (metrics["cached_tokens"], metrics["tokens_reasoning"]) == (520, 52)
    assert run["verifier_invocations"][0]["model_call_ids"] == [calls[4]["model_call_id"]]
    assert "gaps" not in run

    assert [(c["status_code"], c["error_category"]) for c in out["1-0"]["calls"]] == [
        (200, "stream_truncated"),
        (429, "rate_limit"),
    ]
    assert out["2-0"]["gaps"] == [{"code": "model_call_capture_no_records"}]
    (late,) = out["3-0"]["calls"]  # awaited: the row landed, the claim went
    assert (late["status_code"], late["error_category"], late["tokens_total"]) == (200, None, 155)
    assert "gaps" not in out["3-0"]

    # The same rows written directly, as NeMo Gym's model servers would: the same attachment.
    direct = tmp_path / "direct"
    for rollout_id in out:
        for row in store.read(rollout_id):
            CaptureStore(direct).record(rollout_id, row)
    for rollout_id, attachment in out.items():
        task, index = rollout_id.split("-")
        record = {"_ng_task_index": int(task), "_ng_rollout_index": int(index), "reward": 1.0}
        assert merge_model_call_capture_into_record(record, [direct])["ng_model_call_capture"] == attachment


async def test_the_quiescence_wait_returns_once_the_streamed_row_is_durable(
    proxied: tuple[str, Path],
) -> None:
    base, root = proxied
    store = CaptureStore(root)
    request = {"model": "scripted-slow-0.05", "messages": [], "stream": True}
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        call = asyncio.ensure_future(client.post("/ng-rollout/4-0/v1/chat/completions", json=request))
        async with asyncio.timeout(30):  # a deadline: fails, never hangs
            while not await asyncio.to_thread(store.live_claims, "4-0"):
                await asyncio.sleep(0.01)
        assert await await_model_call_capture_quiescence("4-0", [store], timeout_s=30, poll_s=0.01)
        (row,) = store.read("4-0")  # released only after the row
        assert row["error_category"] is None and row["response"]["usage"]["total_tokens"] == 155
        assert (await call).status_code == 200
