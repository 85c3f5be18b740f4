"""The middleware driven at the ASGI level as NeMo Gym drives its own capture middleware:
hand-built scopes, apps that stream, fail or raise. Each case records what NeMo Gym's model-server
capture records for it (its ``_CaptureMiddleware``, public source), so a NeMo Gym deployment that
swaps its capture for ours keeps the same evidence (issue 19, items 1-10)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import openai
import orjson
import pytest

from rollout_capture import CaptureStore
from rollout_capture.call_records import call_record_dict
from rollout_capture.producer import CaptureMiddleware, ProducerSettings
from rollout_capture.producer.proxy import CaptureProxy
from rollout_capture.producer.settings import ProxySettings

from .support.scripted_upstream import CHAT, ScriptedUpstream, chat_events, messages_events, responses_events
from .support.servers import ThreadedServer

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]
CHAT_PATH = "/ng-rollout/{}/v1/chat/completions"
PATHS = {
    "chat": "/ng-rollout/{}/v1/chat/completions",
    "responses": "/ng-rollout/{}/v1/responses",
    "messages": "/ng-rollout/{}/v1/messages",
}
SSE = [(b"content-type", b"text/event-stream")]
JSON = [(b"content-type", b"application/json")]


def event(kind: str | None, body: dict[str, Any]) -> bytes:
    head = b"" if kind is None else b"event: " + kind.encode() + b"\n"
    return head + b"data: " + orjson.dumps(body) + b"\n\n"


def streaming(
    events: list[bytes], *, status: int = 200, raise_after: BaseException | None = None, end: bool = True
) -> App:
    """An app answering ``events`` as a stream; raising ``raise_after`` once they are sent, or
    returning without its last message when ``end`` is False."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": status, "headers": SSE})
        for chunk in events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        if raise_after is not None:
            raise raise_after
        if end:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def raising(exc: BaseException) -> App:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        raise exc

    return app


class Seen:
    """An app that answers the chat completion and keeps the scopes it got."""

    def __init__(self) -> None:
        self.scopes: list[dict[str, Any]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.scopes.append(scope)
        await receive()
        body = orjson.dumps(CHAT)
        await send({"type": "http.response.start", "status": 200, "headers": JSON})
        await send({"type": "http.response.body", "body": body, "more_body": False})


async def drive(
    middleware: Any,
    path: str,
    body: bytes = b'{"model": "m", "stream": true}',
    **scope: Any,
) -> tuple[list[dict[str, Any]], BaseException | None]:
    """One request as NeMo Gym's tests make it: a hand-built scope (``scope`` adds or, with None,
    removes keys), the body in one message. Returns what was sent and what the app raised."""
    built: dict[str, Any] = {
        "type": "http",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "headers": [(b"content-type", b"application/json")],
        "query_string": b"",
    }
    for key, value in scope.items():
        if value is None:
            built.pop(key, None)
        else:
            built[key] = value
    sent: list[dict[str, Any]] = []
    requested = False

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client stays
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    try:
        await middleware(built, receive, send)
    except Exception as exc:
        return sent, exc
    return sent, None


async def row_of(tmp_path: Path, app: App, dialect: str = "chat", **kwargs: Any) -> dict[str, Any]:
    """The one row the middleware writes for one call to ``app``."""
    rollout_id = f"p-{dialect}"
    await drive(
        CaptureMiddleware(app, capture_dir=str(tmp_path)), PATHS[dialect].format(rollout_id), **kwargs
    )
    (row,) = CaptureStore(tmp_path).read(rollout_id)
    return row


# ---------------------------------------------------------------- 1. an error as the first event

FIRST_ERRORS = {
    "messages": event("error", {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}),
    "responses": event("error", {"type": "error", "code": "server_error", "message": "busy"}),
    "chat": event(None, {"error": {"message": "busy", "type": "server_error"}}),
}


@pytest.mark.parametrize("dialect", sorted(FIRST_ERRORS))
async def test_a_200_stream_whose_first_event_is_an_error_is_upstream_error(
    tmp_path: Path, dialect: str
) -> None:
    row = await row_of(tmp_path, streaming([FIRST_ERRORS[dialect]]), dialect)
    assert (row["status_code"], row["error_category"], row["response"]) == (200, "upstream_error", None)
    assert "busy" in row["response_raw"]  # what the stream said is kept


async def test_an_error_after_message_start_is_upstream_error_too(tmp_path: Path) -> None:
    row = await row_of(tmp_path, streaming([messages_events()[0], FIRST_ERRORS["messages"]]), "messages")
    assert (row["error_category"], row["response"]["id"]) == ("upstream_error", "msg_scripted")


# ---------------------------------------------------------------- 2. exceptions the app raised


def _answer(status: int) -> httpx.Response:
    request = httpx.Request("POST", "http://judge/v1/chat/completions")
    return httpx.Response(status, json={"error": {"message": f"judge said {status}"}}, request=request)


class _Lazy(Exception):
    """An exception whose answer fails when touched (a response object not read yet)."""

    @property
    def response(self) -> Any:
        raise RuntimeError("the response was never read")

    @property
    def status_code(self) -> int:
        raise RuntimeError("not there either")


def _unread(status: int) -> httpx.HTTPStatusError:
    """httpx's status error over a streamed answer never read: its content raises when touched."""
    request = httpx.Request("POST", "http://judge/v1/chat/completions")
    response = httpx.Response(status, request=request, stream=httpx.ByteStream(b"never read"))
    return httpx.HTTPStatusError("unread", request=request, response=response)


EXCEPTIONS: list[tuple[str, BaseException, int | None, str]] = [
    ("TimeoutError", TimeoutError(), None, "timeout"),
    ("asyncio.TimeoutError", asyncio.TimeoutError(), None, "timeout"),  # noqa: UP041 (as servers spell it)
    ("httpx.ReadTimeout", httpx.ReadTimeout("read"), None, "timeout"),
    ("httpx.ConnectTimeout", httpx.ConnectTimeout("connect"), None, "timeout"),
    ("aiohttp.ServerTimeoutError", aiohttp.ServerTimeoutError("read"), None, "timeout"),
    ("aiohttp.ConnectionTimeoutError", aiohttp.ConnectionTimeoutError("connect"), None, "timeout"),
    ("ConnectionError", ConnectionError("refused"), None, "connection"),
    ("ConnectionRefusedError", ConnectionRefusedError(), None, "connection"),
    ("httpx.ConnectError", httpx.ConnectError("refused"), None, "connection"),
    ("aiohttp.ClientConnectionError", aiohttp.ClientConnectionError(), None, "connection"),
    (
        "openai.APIConnectionError",
        openai.APIConnectionError(request=_answer(500).request),
        None,
        "connection",
    ),
    (
        "openai.RateLimitError",
        openai.RateLimitError("slow", response=_answer(429), body=None),
        429,
        "rate_limit",
    ),
    (
        "openai.AuthenticationError",
        openai.AuthenticationError("who", response=_answer(401), body=None),
        401,
        "auth",
    ),
    (
        "openai.InternalServerError",
        openai.InternalServerError("oops", response=_answer(503), body=None),
        503,
        "upstream_error",
    ),
    (
        "httpx.HTTPStatusError",
        httpx.HTTPStatusError("x", request=_answer(403).request, response=_answer(403)),
        403,
        "auth",
    ),
    ("aiohttp.ClientResponseError", aiohttp.ClientResponseError(None, (), status=404), 404, "not_found"),  # type: ignore[arg-type]
    ("a lazy answer", _Lazy("lazy"), None, "exception"),
    ("an answer never read", _unread(502), 502, "upstream_error"),
    ("RuntimeError", RuntimeError("bug"), None, "exception"),
]


@pytest.mark.parametrize(
    ("exc", "status", "category"), [e[1:] for e in EXCEPTIONS], ids=[e[0] for e in EXCEPTIONS]
)
async def test_exceptions_are_classified_as_nemo_gym_does(
    tmp_path: Path, exc: BaseException, status: int | None, category: str
) -> None:
    middleware = CaptureMiddleware(raising(exc), capture_dir=str(tmp_path))
    _, raised = await drive(middleware, CHAT_PATH.format("x-1"), b'{"model": "m"}')
    assert raised is exc  # the server's own answer to it (a 500) is left to the server
    (row,) = CaptureStore(tmp_path).read("x-1")
    assert (row["status_code"], row["error_category"]) == (status, category)
    if status is not None and not isinstance(exc, aiohttp.ClientResponseError | httpx.HTTPStatusError):
        assert row["response"] == {"error": {"message": f"judge said {status}"}}  # the answer it carried
        assert row["response_raw"] == _answer(status).text  # and its body as it came, as NeMo Gym keeps it
    if isinstance(exc, _Lazy) or exc.args == ("unread",):
        assert row["response"] is None and "response_raw" not in row


# ---------------------------------------------------------------- 3. raised mid-stream, cut short


async def test_an_app_that_raises_mid_stream_is_an_exception_with_the_partial_response(
    tmp_path: Path,
) -> None:
    events = chat_events(include_usage=False)[:4]
    row = await row_of(tmp_path, streaming(events, raise_after=RuntimeError("mid-stream")))
    assert (row["status_code"], row["error_category"]) == (200, "exception")
    assert row["response"]["choices"][0]["message"]["reasoning_content"].startswith("The user")
    timed_out = await row_of(tmp_path / "t", streaming(events, raise_after=httpx.ReadTimeout("slow")))
    assert timed_out["error_category"] == "timeout"
    failing = await row_of(tmp_path / "s", streaming(events, status=500, raise_after=RuntimeError("x")))
    assert (failing["status_code"], failing["error_category"]) == (500, "upstream_error")


@pytest.mark.parametrize(
    ("dialect", "events"),
    [
        # No response object yet: NeMo Gym says stream_truncated, never capture_parse_error.
        (
            "responses",
            [event("response.output_text.delta", {"type": "response.output_text.delta", "delta": "a"})],
        ),
        ("messages", [event("ping", {"type": "ping"})]),
        ("chat", chat_events(include_usage=False)[:3]),
    ],
    ids=["responses-deltas-only", "messages-ping-only", "chat-half"],
)
async def test_a_stream_without_its_terminal_event_is_stream_truncated(
    tmp_path: Path, dialect: str, events: list[bytes]
) -> None:
    row = await row_of(tmp_path, streaming(events), dialect)
    assert (row["status_code"], row["error_category"]) == (200, "stream_truncated")


# ---------------------------------------------------------------- 4. Responses terminal states


@pytest.mark.parametrize(
    ("terminal", "status", "category"),
    [("response.incomplete", "incomplete", "incomplete"), ("response.failed", "failed", "upstream_error")],
)
async def test_responses_terminal_states(tmp_path: Path, terminal: str, status: str, category: str) -> None:
    events = responses_events()[:-1]
    final = orjson.loads(events[-1].split(b"data: ", 1)[1])  # any event carrying the response
    response = {"id": "resp_scripted", "object": "response", "status": status, "output": []}
    if status == "incomplete":
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        response["error"] = {"code": "server_error", "message": "the model failed"}
    assert final["type"]
    events.append(event(terminal, {"type": terminal, "response": response}))
    row = await row_of(tmp_path, streaming(events), "responses")
    assert (row["error_category"], row["response"]["status"]) == (category, status)
    if status == "incomplete":
        assert call_record_dict(row, 0, include_payloads=False)["finish_reason"] == "max_output_tokens"


async def test_a_named_event_without_data_is_that_event(tmp_path: Path) -> None:
    """``event: response.incomplete`` and no data line: the openai SDK dispatches it as that event
    (not a keep-alive), so the stream ended incomplete, and its last byte waited for the row."""
    events = [*responses_events()[:-1], b"event: response.incomplete\n\n"]
    sent, _ = await drive(
        CaptureMiddleware(streaming(events), capture_dir=str(tmp_path)), PATHS["responses"].format("named")
    )
    (row,) = CaptureStore(tmp_path).read("named")
    assert (row["status_code"], row["error_category"]) == (200, "incomplete")
    assert row["response"]["status"] == "incomplete" and row["response"]["output"]  # what came, kept
    bodies = [m.get("body", b"") for m in sent if m["type"] == "http.response.body"]
    assert bodies[-1].endswith(b"event: response.incomplete\n\n")  # forwarded after the row, as it came


# ---------------------------------------------------------------- 5. a chat stream of no chat chunk


async def test_a_chat_stream_without_a_chat_chunk_is_a_capture_parse_error(tmp_path: Path) -> None:
    events = [
        event(None, {"object": "keepalive"}),
        event(None, {"choices": [], "usage": None}),
        b"data: [DONE]\n\n",
    ]
    row = await row_of(tmp_path, streaming(events))
    assert (row["status_code"], row["error_category"], row["response"]) == (200, "capture_parse_error", None)
    assert "keepalive" in row["response_raw"]


# ---------------------------------------------------------------- 6. reasoning_content


async def test_reassembled_chat_reasoning_is_named_reasoning_content(tmp_path: Path) -> None:
    vllm = [
        chunk.replace(b'"reasoning_content"', b'"reasoning"') for chunk in chat_events(include_usage=False)
    ]
    assert any(b'"reasoning"' in chunk for chunk in vllm)
    message = (await row_of(tmp_path, streaming(vllm)))["response"]["choices"][0]["message"]
    assert message["reasoning_content"] == CHAT["choices"][0]["message"]["reasoning_content"]  # type: ignore[index]
    assert "reasoning" not in message


# ---------------------------------------------------------------- 7. capture off


async def test_capture_off_strips_the_prefix_forwards_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ROLLOUT_CAPTURE_DIR", raising=False)
    monkeypatch.setenv("ROLLOUT_CAPTURE_ENABLED", "false")
    app = Seen()
    middleware = CaptureMiddleware(app)  # as vLLM's --middleware: no arguments, no capture dir
    assert middleware.writer is None and not middleware.settings.enabled
    for path in (CHAT_PATH.format("off-1"), "/ng-rollout/off-1/training-token-capture/v1/chat/completions"):
        sent, raised = await drive(middleware, path, b'{"model": "m"}')
        assert raised is None and sent[0]["status"] == 200
        assert orjson.loads(sent[-1]["body"]) == CHAT
    assert [s["path"] for s in app.scopes] == ["/v1/chat/completions"] * 2
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="ROLLOUT_CAPTURE_ENABLED=false"):
        ProducerSettings.from_env({})  # on, without a dir: the error names the switch


def test_the_proxy_with_capture_off_forwards_under_the_upstreams_path(tmp_path: Path) -> None:
    upstream = ScriptedUpstream()
    served = ThreadedServer(upstream)
    try:
        proxy = CaptureProxy(ProxySettings(upstream=served.url, enabled=False))
        answer = asyncio.run(_post(proxy, CHAT_PATH.format("off-2"), {"model": "scripted", "messages": []}))
        assert answer.json()["id"] == CHAT["id"]
        assert upstream.seen[-1]["path"] == "/v1/chat/completions"
        asyncio.run(proxy.aclose())
    finally:
        served.stop()
    assert list(tmp_path.iterdir()) == []


async def _post(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
        return await client.post(path, json=body)


# ---------------------------------------------------------------- 8. the token-capture path


async def test_the_training_token_capture_path_is_stripped_and_forwarded(tmp_path: Path) -> None:
    app = Seen()
    middleware = CaptureMiddleware(app, capture_dir=str(tmp_path))
    sent, _ = await drive(
        middleware, "/ng-rollout/tok-1/training-token-capture/v1/chat/completions", b'{"model": "m"}'
    )
    assert sent[0]["status"] == 200 and app.scopes[-1]["path"] == "/v1/chat/completions"
    assert app.scopes[-1]["raw_path"] == b"/v1/chat/completions"
    (row,) = CaptureStore(tmp_path).read("tok-1")  # the model call's row, as NeMo Gym writes one there
    assert (row["dialect"], row["error_category"], row["response"]["id"]) == ("chat", None, CHAT["id"])
    await drive(middleware, "/ng-rollout/tok-1/training-token-capture/v1/models", b"", method="GET")
    assert app.scopes[-1]["path"] == "/v1/models" and len(CaptureStore(tmp_path).read("tok-1")) == 1


# ---------------------------------------------------------------- 9. lenient scopes


@pytest.mark.parametrize("missing", [("method",), ("method", "raw_path", "query_string", "headers")])
async def test_a_scope_without_optional_looking_keys_is_captured(
    tmp_path: Path, missing: tuple[str, ...]
) -> None:
    app = Seen()
    middleware = CaptureMiddleware(app, capture_dir=str(tmp_path))
    sent, raised = await drive(
        middleware, CHAT_PATH.format("lenient"), b'{"model": "m"}', **dict.fromkeys(missing)
    )
    assert raised is None and sent[0]["status"] == 200
    (row,) = CaptureStore(tmp_path).read("lenient")
    assert row["error_category"] is None and row["request"] == {"model": "m"}
    assert app.scopes[-1]["path"] == "/v1/chat/completions"


# ---------------------------------------------------------------- 10. writer threads stop


def _writer_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("rollout-capture_"))


async def _lifespan(app: Any) -> None:
    """A lifespan as uvicorn runs one: startup, then shutdown."""
    messages = iter([{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}])
    done: list[str] = []

    async def receive() -> dict[str, Any]:
        return next(messages)

    async def send(message: dict[str, Any]) -> None:
        done.append(message["type"])

    await app({"type": "lifespan"}, receive, send)
    assert done == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


class LifespanApp(Seen):
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        await super().__call__(scope, receive, send)


async def test_writer_threads_stop_on_lifespan_shutdown_and_on_close(tmp_path: Path) -> None:
    before = _writer_threads()
    apps = [CaptureMiddleware(LifespanApp(), capture_dir=str(tmp_path / f"app-{n}")) for n in range(3)]
    for n, middleware in enumerate(apps):
        await drive(middleware, CHAT_PATH.format(f"t-{n}"), b'{"model": "m"}')
    assert _writer_threads() >= before + 3  # each started its writer's threads
    for middleware in apps[:2]:
        await _lifespan(middleware)
    await asyncio.to_thread(apps[2].close)
    assert _writer_threads() == before
    # A call after the stop still lands its row (the threads start again), then stop again.
    await drive(apps[0], CHAT_PATH.format("t-late"), b'{"model": "m"}')
    assert len(CaptureStore(tmp_path / "app-0").read("t-late")) == 1
    await asyncio.to_thread(apps[0].close)
    assert _writer_threads() == before


async def test_an_sdk_error_whose_answer_is_not_json_keeps_it_raw(tmp_path: Path) -> None:
    request = httpx.Request("POST", "http://judge/v1/chat/completions")
    answer = httpx.Response(503, text="upstream busy, try later", request=request)
    exc = httpx.HTTPStatusError("busy", request=request, response=answer)
    row = await row_of(tmp_path, raising(exc), body=b'{"model": "m"}')
    assert (row["status_code"], row["error_category"], row["response"]) == (503, "upstream_error", None)
    assert row["response_raw"] == "upstream busy, try later"
