"""CaptureMiddleware on real ASGI servers and apps: the SDKs through uvicorn, Starlette's
add_middleware (with arguments, and with none as vLLM's --middleware does), failed
writes, a failing app, a client that leaves, and S3."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rollout_capture import CaptureStore, merge_model_call_capture_into_record
from rollout_capture.producer import CaptureMiddleware, ProducerSettings
from rollout_capture.producer.proxy import CaptureProxy
from rollout_capture.producer.settings import ProxySettings
from rollout_capture.store import UnwritableRootError

from .conftest import S3
from .support.producer_calls import (
    DIALECTS,
    body_then_silence,
    check_row,
    openai_client,
    post_scope,
    sdk_call,
)
from .support.scripted_upstream import CHAT, CUT_ANSWERS, RAISING, ScriptedUpstream
from .support.servers import ThreadedServer

SERVER = "policy-mw"


class Served:
    """A scripted model server wrapped in the middleware, served by uvicorn."""

    def __init__(self, capture_dir: str, **settings: Any) -> None:
        self.settings = ProducerSettings(capture_dir=capture_dir, server_name=SERVER, **settings)
        self.app = ScriptedUpstream()
        self.server = ThreadedServer(CaptureMiddleware(self.app, settings=self.settings))
        self.url = self.server.url
        self.store = CaptureStore(capture_dir, storage_options=self.settings.storage_options)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    server = Served(str(tmp_path_factory.mktemp("mw-captures")))
    yield server
    server.server.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("dialect", DIALECTS)
def test_sdk_calls_are_captured(served: Served, dialect: str, stream: bool) -> None:
    rollout_id = f"mw-{dialect}-{int(stream)}"
    assert sdk_call(served.url, rollout_id, dialect, stream)["tool"] == "get_weather"
    (row,) = served.store.read(rollout_id)  # durable before the SDK had the last byte
    check_row(row, dialect, server_name=SERVER)
    assert served.store.claims([rollout_id]) == {}


def test_the_app_sees_paths_without_the_prefix_and_only_model_calls_are_captured(served: Served) -> None:
    with httpx.Client(base_url=served.url) as client:
        assert client.get("/ng-rollout/mw-p/v1/models").json()["path"] == "/v1/models"
        assert client.get("/v1/models").json()["path"] == "/v1/models"
        answer = client.post("/ng-rollout/mw-p/v1/chat/completions?q=1", json={"model": "scripted"})
        assert answer.json()["id"] == CHAT["id"]
        assert served.app.seen[-1]["path"] == "/v1/chat/completions" and served.app.seen[-1]["query"] == "q=1"
        bad = client.post("/ng-rollout/..%2Fx/v1/chat/completions", json={"model": "scripted"})
        assert bad.status_code == 400 and "'../x'" in bad.json()["error"]["message"]
    assert len(served.store.read("mw-p")) == 1
    assert not list(Path(served.settings.capture_dir).glob("..*"))


def test_upstream_errors_and_the_verifier_header(served: Served) -> None:
    with pytest.raises(openai.RateLimitError):
        openai_client(served.url, "mw-e").chat.completions.create(model="scripted-429", messages=[])
    judge = openai_client(
        served.url, "mw-e", default_headers={"X-Rollout-Capture-Verifier-Invocation-Id": "v-1"}
    )
    judge.chat.completions.create(model="scripted", messages=[])
    first, second = served.store.read("mw-e")
    assert (first["status_code"], first["error_category"]) == (429, "rate_limit")
    assert second["verifier_invocation_id"] == "v-1" and "verifier_invocation_id" not in first


def test_a_chat_stream_without_usage_stays_without_it_for_the_client(served: Served) -> None:
    chunks = list(
        openai_client(served.url, "mw-u").chat.completions.create(model="scripted", messages=[], stream=True)
    )
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)
    assert served.app.seen[-1]["body"]["stream_options"] == {"include_usage": True}
    assert served.store.read("mw-u")[0]["response"]["usage"]["total_tokens"] == 155


def test_events_reach_the_client_as_the_app_sends_them(served: Served) -> None:
    request = {"model": "scripted-gated-mw-s", "messages": [], "stream": True}
    with (
        httpx.Client(base_url=served.url) as client,
        client.stream("POST", "/ng-rollout/mw-s/v1/chat/completions", json=request) as answer,
    ):
        chunks = answer.iter_raw()
        assert next(chunks).startswith(b"data: ")
        assert served.store.read("mw-s") == [] and served.store.live_claims("mw-s")  # the app is at its gate
        served.app.gate("mw-s").set()
        rest = b"".join(chunks)
    assert rest.endswith(b"data: [DONE]\n\n")
    (row,) = served.store.read("mw-s")
    assert row["error_category"] is None and row["response"]["usage"]["total_tokens"] == 155


# ---------------------------------------------------------------- mounted with add_middleware


async def chat_endpoint(request: Request) -> JSONResponse:
    body = await request.json()
    if body.get("model") == "boom":
        raise RuntimeError("the app failed")
    return JSONResponse(CHAT)


def starlette_app() -> Starlette:
    return Starlette(routes=[Route("/v1/chat/completions", chat_endpoint, methods=["POST"])])


async def post(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://mw") as client:
        return await client.post(path, json=body)


async def test_add_middleware_with_arguments_and_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = starlette_app()
    app.add_middleware(CaptureMiddleware, capture_dir=str(tmp_path / "args"), server_name="a")
    assert (await post(app, "/ng-rollout/s-1/v1/chat/completions", {"model": "m"})).json()["id"] == CHAT["id"]
    assert CaptureStore(tmp_path / "args").read("s-1")[0]["model_ref"]["name"] == "a"

    # vLLM's --middleware: imported by path, added with no arguments.
    monkeypatch.setenv("ROLLOUT_CAPTURE_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("ROLLOUT_CAPTURE_SERVER_NAME", "from-env")
    monkeypatch.setenv("ROLLOUT_CAPTURE_CLAIM_TTL_S", "30")
    app = starlette_app()
    app.add_middleware(CaptureMiddleware)
    assert (await post(app, "/ng-rollout/s-2/v1/chat/completions", {"model": "m"})).status_code == 200
    (row,) = CaptureStore(tmp_path / "env").read("s-2")
    assert row["model_ref"] == {"type": "responses_api_models", "name": "from-env"}
    assert row["response"]["usage"] == CHAT["usage"]


async def test_what_a_nemo_gym_model_server_says_of_its_upstream_is_recorded(tmp_path: Path) -> None:
    """NeMo Gym 0.7's model servers say who answered in ``request.state.nemo_gym_model_execution``
    (its vLLM server answering a prompt past the context itself): under our middleware the row
    carries those four facts, and that local answer's category, as NeMo Gym's capture writes it."""

    async def local_answer(request: Request) -> JSONResponse:
        request.state.nemo_gym_model_execution = {
            "upstream_attempted": True,
            "response_source": "local",
            "upstream_status_code": None,
            "local_response_reason": "context_length_exceeded",
        }
        return JSONResponse({**CHAT, "choices": [{**CHAT["choices"][0], "finish_reason": "length"}]})

    app = Starlette(routes=[Route("/v1/chat/completions", local_answer, methods=["POST"])])
    app.add_middleware(CaptureMiddleware, capture_dir=str(tmp_path))
    assert (await post(app, "/ng-rollout/ctx-1/v1/chat/completions", {"model": "m"})).status_code == 200
    plain = starlette_app()
    plain.add_middleware(CaptureMiddleware, capture_dir=str(tmp_path))
    assert (await post(plain, "/ng-rollout/ctx-2/v1/chat/completions", {"model": "m"})).status_code == 200
    (row,) = CaptureStore(tmp_path).read("ctx-1")
    assert (row["upstream_attempted"], row["response_source"], row["local_response_reason"]) == (
        True,
        "local",
        "context_length_exceeded",
    )
    assert (row["status_code"], row["error_category"]) == (200, "context_length_exceeded")
    (row,) = CaptureStore(tmp_path).read("ctx-2")  # an app that says nothing: nothing is said
    assert "response_source" not in row and row["error_category"] is None


async def test_a_middleware_that_cannot_write_its_capture_root_fails_the_apps_startup(
    flaky_s3: tuple[S3, Any], tmp_path: Path
) -> None:
    """Issue 26: a read-only bucket (every PUT refused) or a root under a file: the app's lifespan
    startup fails naming the root, instead of serving calls it never records."""
    via, wire = flaky_s3
    wire.deny_on(b"PUT /")
    read_only = via.url("caps")
    app = starlette_app()
    app.add_middleware(CaptureMiddleware, capture_dir=read_only, storage_options=via.storage_options)

    async def receive() -> dict[str, Any]:
        return {"type": "lifespan.startup"}

    async def send(message: dict[str, Any]) -> None:
        pass

    with pytest.raises(UnwritableRootError, match=f"capture root {read_only} cannot be written"):
        await app({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send)
    assert wire.denied >= 1 and via.fs().find(via.bucket) == []  # refused, nothing left behind
    (tmp_path / "file").write_text("not a folder")
    under_a_file = str(tmp_path / "file" / "caps")
    with pytest.raises(UnwritableRootError, match=f"capture root {under_a_file} cannot be written"):
        CaptureMiddleware(starlette_app(), capture_dir=under_a_file)


async def test_a_failed_capture_write_never_fails_the_call(tmp_path: Path) -> None:
    (tmp_path / "w-1.capture.jsonl").mkdir()  # the row cannot be appended
    app = starlette_app()
    app.add_middleware(CaptureMiddleware, capture_dir=str(tmp_path))
    answer = await post(app, "/ng-rollout/w-1/v1/chat/completions", {"model": "m"})
    assert answer.status_code == 200 and answer.json() == CHAT
    store = CaptureStore(tmp_path)
    assert store.is_incomplete("w-1")
    assert not (tmp_path / "w-1.capture.claims").exists()  # released all the same, its folder with it
    (tmp_path / "w-1.capture.jsonl").rmdir()
    record = {"_ng_rollout_id": "w-1"}
    gaps = merge_model_call_capture_into_record(record, [store])["ng_model_call_capture"]["gaps"]
    assert {"code": "model_call_capture_incomplete"} in gaps


async def test_an_app_that_fails_leaves_an_exception_row(tmp_path: Path) -> None:
    app = starlette_app()
    app.add_middleware(CaptureMiddleware, capture_dir=str(tmp_path))
    answer = await post(app, "/ng-rollout/x-1/v1/chat/completions", {"model": "boom"})
    assert answer.status_code == 500
    (row,) = CaptureStore(tmp_path).read("x-1")
    assert (row["status_code"], row["error_category"], row["response"]) == (None, "exception", None)


async def test_a_client_that_leaves_mid_stream_leaves_a_truncated_row(tmp_path: Path) -> None:
    """A streaming app that stops when its client disconnects, as model servers do: its stream
    ended without its terminal event, which NeMo Gym's capture reads ``stream_truncated`` (issue
    34); an app cancelled instead (NeMo Gym's servers cancel on a disconnect) is ``cancelled``."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.ensure_future(watch())
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        for n in range(100):
            if gone.is_set():
                return  # no final message: the client is gone
            chunk = {
                "id": "c",
                "choices": [{"index": 0, "delta": {"content": f"{n} "}, "finish_reason": None}],
            }
            await send(
                {
                    "type": "http.response.body",
                    "body": b"data: " + httpx_json(chunk) + b"\n\n",
                    "more_body": True,
                }
            )
            await asyncio.sleep(0.01)
        watcher.cancel()

    middleware = CaptureMiddleware(app, capture_dir=str(tmp_path))
    sent: list[dict[str, Any]] = []
    requested = False

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": b'{"model": "m", "stream": true}', "more_body": False}
        await asyncio.sleep(0.05)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    path = "/ng-rollout/g-1/v1/chat/completions"
    scope = post_scope(path)
    await middleware(scope, receive, send)
    (row,) = CaptureStore(tmp_path).read("g-1")
    assert (row["status_code"], row["error_category"]) == (200, "stream_truncated")
    assert row["response"]["choices"][0]["message"]["content"].startswith("0 1 ")
    assert not any(m.get("more_body") is False for m in sent)


def httpx_json(value: Any) -> bytes:
    import orjson

    return orjson.dumps(value)


def test_the_middleware_writes_objects_on_s3(s3: S3) -> None:
    on_s3 = Served(s3.url("mw"), storage_options=s3.storage_options)
    try:
        for dialect in DIALECTS:
            sdk_call(on_s3.url, "mw-s3", dialect, stream=True)
        rows = on_s3.store.read("mw-s3")
        for row, dialect in zip(rows, DIALECTS, strict=True):
            check_row(row, dialect, server_name=SERVER)
        assert on_s3.store.claims(["mw-s3"]) == {}
    finally:
        on_s3.server.stop()


@pytest.mark.parametrize("producer", ["middleware", "proxy"])
async def test_a_call_cancelled_while_claiming_leaves_no_claim(producer: str, monkeypatch: Any) -> None:
    """Spec 3: on an object store the claim is written on a thread; a cancel meanwhile must not
    leave it live (it would hold enrichment for a whole TTL). The call was forwarded while the
    claim was written (spec 11): it may leave its row, never its claim."""
    capture_dir = f"memory://claiming-{uuid.uuid4().hex}"
    app: Any
    if producer == "middleware":  # the objects layout: a claim file a call (the journal's: test_journal)
        app = CaptureMiddleware(ScriptedUpstream(), capture_dir=capture_dir, layout="objects")
    else:  # the upstream is never reached
        app = CaptureProxy(
            ProxySettings(capture_dir=capture_dir, upstream="http://127.0.0.1:9", layout="objects")
        )
    store = app.writer.store
    entered, gate = threading.Event(), threading.Event()
    put_live = store._backend.put_live

    def slow_put_live(path: str, data: bytes) -> None:
        entered.set()
        gate.wait(10)
        put_live(path, data)

    monkeypatch.setattr(store._backend, "put_live", slow_put_live)

    receive = body_then_silence()

    async def send(message: dict[str, Any]) -> None:
        raise AssertionError(f"nothing is answered: {message}")

    path = "/ng-rollout/r1/v1/chat/completions"
    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "headers": []}
    call = asyncio.ensure_future(app(scope, receive, send))
    assert await asyncio.to_thread(entered.wait, 10)
    call.cancel()
    gate.set()  # the claim lands after the cancel
    with pytest.raises(asyncio.CancelledError):
        await call
    assert store.claims(["r1"]) == {}
    assert len(store.read("r1")) <= 1  # the one call's row, if it got that far


@pytest.mark.parametrize("where", ["local", "object_store"])
async def test_a_failed_row_write_is_logged_once(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The store logs a failed write and marks the rollout; the producer adds no second traceback."""
    capture_dir = str(tmp_path) if where == "local" else f"memory://unwritten-{uuid.uuid4().hex}"
    middleware = CaptureMiddleware(
        starlette_app(), capture_dir=capture_dir, layout="auto" if where == "local" else "objects"
    )
    store = middleware.writer.store
    if where == "local":
        (tmp_path / "w-2.capture.jsonl").mkdir()  # the row cannot be appended
    else:

        def refuse(path: str, data: bytes) -> None:
            raise OSError("the bucket refused it")

        monkeypatch.setattr(store._backend, "create", refuse)
    with caplog.at_level(logging.WARNING, logger="rollout_capture"):
        answer = await post(middleware, "/ng-rollout/w-2/v1/chat/completions", {"model": "m"})
    assert answer.status_code == 200 and store.is_incomplete("w-2")
    ours = [
        r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("rollout_capture")
    ]
    (warning,) = ours  # (not asyncio's word on another test's session, collected meanwhile)
    assert "w-2" in warning.getMessage() and warning.exc_info is not None


@pytest.mark.parametrize(("model", "stream", "expected"), CUT_ANSWERS)
def test_an_answer_cut_off_is_classified_as_the_proxy_does(
    served: Served, model: str, stream: bool, expected: tuple[int, str]
) -> None:
    """As the proxy, except that here the app raised to cut it: ``exception``, as NeMo Gym says
    (an error status keeps its own category)."""
    if model in RAISING and expected[0] < 400:
        expected = (expected[0], "exception")
    rollout_id = f"cut-off-{model}"
    request = {"model": model, "messages": [], "stream": stream}
    # The upstream dropped the connection: so does the producer.
    with httpx.Client(base_url=served.url) as client, contextlib.suppress(httpx.HTTPError):
        client.post(f"/ng-rollout/{rollout_id}/v1/chat/completions", json=request).read()
    (row,) = served.store.read(rollout_id)
    assert (row["status_code"], row["error_category"]) == expected
    assert served.store.claims([rollout_id]) == {}
