"""Model calls no rollout names are never forwarded in silence; a call's session is kept (issue 45).

In-process (httpx's ASGI transport, no socket): the middleware before a scripted app.
"""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest

from rollout_capture import CaptureStore
from rollout_capture.producer import CaptureMiddleware, ProducerSettings
from rollout_capture.producer.exchange import session_of
from rollout_capture.producer.routing import Route
from rollout_capture.producer.unfiled import UnfiledCalls

from .support.scripted_upstream import ScriptedUpstream

LOGGER = "rollout_capture.producer"


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_unfiled_calls_are_said_at_once_then_at_every_power_of_ten_and_counted_at_the_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    unfiled = UnfiledCalls("capture proxy")
    caplog.set_level(logging.WARNING, logger=LOGGER)
    responses, chat = Route("/v1/responses", b"/v1/responses"), Route("/v1/chat/completions", b"")
    for _ in range(99):
        unfiled.saw("POST", responses)
    unfiled.saw("POST", chat)
    unfiled.saw("GET", Route("/v1/models", b"/v1/models"))  # no model call
    unfiled.saw("POST", Route("/v1/responses", b"", rollout_id="r-1", dialect="responses"))  # filed
    said = _warnings(caplog)
    assert [m.split(":")[1].split()[0] for m in said] == ["1", "10", "100"]
    assert "POST /v1/responses" in said[0] and "observability_enabled" in said[0]
    assert "POST /v1/chat/completions" in said[2]
    caplog.clear()
    unfiled.report()
    (summary,) = _warnings(caplog)
    assert "100 model call(s) were forwarded uncaptured (/v1/chat/completions 1, /v1/responses 99)" in summary


def test_a_producer_with_no_unfiled_call_says_nothing_at_the_end(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    UnfiledCalls("capture proxy").report()
    assert _warnings(caplog) == []


def _middleware(tmp_path: Path, **given: object) -> tuple[CaptureMiddleware, ScriptedUpstream]:
    app = ScriptedUpstream()
    settings = ProducerSettings(capture_dir=str(tmp_path / "captures"), server_name="policy")
    return CaptureMiddleware(app, settings=settings, **given), app  # type: ignore[arg-type]


async def test_the_middleware_warns_of_a_model_call_without_a_rollout_and_forwards_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    middleware, app = _middleware(tmp_path)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    transport = httpx.ASGITransport(app=middleware)
    async with httpx.AsyncClient(transport=transport, base_url="http://model") as client:
        answer = await client.post("/v1/responses", json={"model": "scripted", "input": "hi"})
    assert answer.status_code == 200 and app.seen[-1]["path"] == "/v1/responses"
    (said,) = _warnings(caplog)
    assert "capture middleware of policy: 1 model call(s) forwarded uncaptured" in said
    assert not (tmp_path / "captures").exists() or not any((tmp_path / "captures").iterdir())
    caplog.clear()
    middleware.close()
    assert "1 model call(s) were forwarded uncaptured (/v1/responses 1)" in _warnings(caplog)[0]


async def test_a_calls_session_is_its_rows_client_session_id(tmp_path: Path) -> None:
    middleware, _ = _middleware(tmp_path)
    transport = httpx.ASGITransport(app=middleware)
    async with httpx.AsyncClient(transport=transport, base_url="http://model") as client:
        headers = {"X-Session-Id": "invocation-7"}
        await client.post("/ng-rollout/r-1/v1/responses", json={"model": "scripted"}, headers=headers)
        await client.post("/ng-rollout/r-2/v1/responses", json={"model": "scripted"})
    middleware.close()
    store = CaptureStore(str(tmp_path / "captures"))
    (row,) = store.read("r-1")
    assert row["client_session_id"] == "invocation-7"
    (row,) = store.read("r-2")
    assert "client_session_id" not in row


def test_a_session_is_one_value_as_nemo_gym_takes_it() -> None:
    assert session_of([(b"X-Session-Id", b"a")]) == "a"
    assert session_of([(b"x-session-id", b"a"), (b"x-session-id", b"a")]) == "a"
    assert session_of([(b"x-session-id", b"a"), (b"x-session-id", b"b")]) is None
    assert session_of([(b"x-session-id", b"")]) is None
    assert session_of([(b"authorization", b"secret")]) is None


async def test_an_app_that_reads_the_prefix_itself_gets_the_path_as_sent(tmp_path: Path) -> None:
    """NeMo Gym's model servers strip the prefix in their own capture middleware (ours wraps it)."""
    middleware, app = _middleware(tmp_path, strip_prefix=False)
    transport = httpx.ASGITransport(app=middleware)
    async with httpx.AsyncClient(transport=transport, base_url="http://model") as client:
        await client.post("/ng-rollout/r-3/v1/chat/completions", json={"model": "scripted"})
    middleware.close()
    assert app.seen[-1]["path"] == "/ng-rollout/r-3/v1/chat/completions"
    assert len(CaptureStore(str(tmp_path / "captures")).read("r-3")) == 1
