"""A hostile world around the producers (issue 15): a request body cut after the cap, a damaged
stream event, a status no server knows, and paths that would leave the upstream's base path.

Real sockets throughout: a raw client where an HTTP library would fix the request up
(dot segments, broken chunks), the scripted upstream recording what reached it, and a raw
upstream for a status uvicorn itself cannot send.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from rollout_capture import CaptureStore
from rollout_capture.producer import CaptureMiddleware, ProducerSettings

from .conftest import wait_for
from .support.scripted_upstream import CHAT, ScriptedUpstream, chat_events, garbled
from .support.servers import ThreadedServer
from .test_proxy import Proxy


def raw_call(port: int, request: bytes) -> tuple[int, bytes]:
    """Send bytes as they are (no client normalizes anything); ``(status, body)`` of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def post_raw(port: int, path: bytes, body: dict[str, Any]) -> tuple[int, bytes]:
    data = orjson.dumps(body)
    head = b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" % path
    head += b"content-length: %d\r\nconnection: close\r\n\r\n" % len(data)
    return raw_call(port, head + data)


class Middleware:
    """The scripted model server wrapped in the middleware, served by uvicorn."""

    def __init__(self, capture_dir: str, **settings: Any) -> None:
        self.app = ScriptedUpstream()
        self.settings = ProducerSettings(capture_dir=capture_dir, server_name="mw", **settings)
        self.server = ThreadedServer(CaptureMiddleware(self.app, settings=self.settings))
        self.url, self.port = self.server.url, self.server.port
        self.store = CaptureStore(capture_dir)


@pytest.fixture(scope="module")
def proxy(scripted_upstream: tuple[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    served = Proxy(scripted_upstream[0], str(tmp_path_factory.mktemp("hostile-proxy")))
    yield served
    served.server.stop()


@pytest.fixture(scope="module")
def middleware(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Middleware]:
    served = Middleware(str(tmp_path_factory.mktemp("hostile-mw")))
    yield served
    served.server.stop()


# ---------------------------------------------------------------- 3: a request body cut after the cap


@pytest.mark.parametrize("ending", ["disconnect", "malformed-chunk"])
def test_a_request_body_cut_after_the_cap_is_aborted_upstream_and_cancelled(
    scripted_upstream: tuple[str, Any], tmp_path: Path, ending: str
) -> None:
    url, app = scripted_upstream
    proxy = Proxy(url, str(tmp_path), max_body_bytes=1024)
    try:
        _cut_request(proxy, app, f"cut-request-{ending}", ending)
    finally:
        proxy.server.stop()


def _cut_request(proxy: Proxy, app: ScriptedUpstream, rollout_id: str, ending: str) -> None:
    marker = f"marker-{rollout_id}".encode()
    # Over the 1024-byte cap: the proxy forwards it while the rest is still to come.
    first = b'{"model": "scripted", "messages": [{"role": "user", "content": "' + marker + b"y" * 4000
    head = (
        b"POST /ng-rollout/%s/v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n" % rollout_id.encode()
    )
    port = int(proxy.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head + b"%x\r\n%s\r\n" % (len(first), first))
        wait_for(lambda: any(marker in got for got in app.receiving))  # the upstream is reading it
        if ending == "malformed-chunk":
            sock.sendall(b"zz-not-a-size\r\nmore\r\n")
            sock.recv(65536)  # uvicorn answers 400 and closes
    row = wait_for(lambda: proxy.rows(rollout_id))[0]
    assert (row["status_code"], row["error_category"]) == (None, "cancelled")
    assert row["request_truncated"] is True and row["request_raw"].encode() == first[:1024]
    got = wait_for(lambda: [s for s in app.seen if marker in s["raw"]])
    assert [s["complete"] for s in got] == [False]  # aborted: never a complete, well-formed request
    wait_for(lambda: proxy.store.claims([rollout_id]) == {})


def test_a_request_body_cut_after_the_cap_is_cancelled_by_the_middleware(middleware: Middleware) -> None:
    """The app is told the client left (http.disconnect); an app that answers all the same (the
    scripted one does) answers a call that was cancelled: the row says so."""
    rollout_id = "cut-request-mw"
    marker = b"marker-cut-request-mw"
    first = b'{"model": "scripted", "messages": [{"role": "user", "content": "' + marker + b"y" * 4000
    head = (
        b"POST /ng-rollout/%s/v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n" % rollout_id.encode()
    )
    small = Middleware(str(middleware.settings.capture_dir) + "-small", max_body_bytes=1024)
    try:
        with socket.create_connection(("127.0.0.1", small.port), timeout=30) as sock:
            sock.sendall(head + b"%x\r\n%s\r\n" % (len(first), first))
            wait_for(lambda: any(marker in got for got in small.app.receiving))
        row = wait_for(lambda: small.store.read(rollout_id))[0]
        assert row["error_category"] == "cancelled" and row["request_truncated"] is True
        assert [s["complete"] for s in small.app.seen] == [False]
    finally:
        small.server.stop()


def test_a_client_that_leaves_mid_answer_after_a_body_past_the_cap_leaves_a_truncated_row(
    scripted_upstream: tuple[str, Any], tmp_path: Path
) -> None:
    url, app = scripted_upstream
    # Patient with the upstream: it waits at its gate as long as the test needs.
    proxy = Proxy(url, str(tmp_path), max_body_bytes=1024, read_timeout_s=60.0)
    marker = b"marker-left-1"
    content = {"role": "user", "content": marker.decode() + "y" * 4000}
    body = orjson.dumps({"model": "scripted-gated-left-1", "stream": True, "messages": [content]})

    def sent() -> Iterator[bytes]:
        yield body[:2000]
        wait_for(lambda: any(marker in got for got in app.receiving))  # forwarded before it is whole
        yield body[2000:]

    try:
        with (
            httpx.Client(base_url=proxy.url) as client,
            client.stream("POST", "/ng-rollout/left-1/v1/chat/completions", content=sent()) as answer,
        ):
            chunks = answer.iter_raw()  # held: a discarded iterator closes the connection at once
            assert next(chunks).startswith(b"data: ")
        (row,) = proxy.wait_rows("left-1")  # the client is gone, the upstream still at its gate
        assert (row["status_code"], row["error_category"]) == (200, "cancelled")  # as a NeMo Gym server says
        assert row["request_truncated"] is True
    finally:
        app.gate("left-1").set()
        proxy.server.stop()


# ---------------------------------------------------------------- 4: a damaged stream event


def _garbled_call(url: str, rollout_id: str) -> bytes:
    request = {
        "model": "scripted-garbled",
        "messages": [],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.Client(base_url=url) as client:
        answer = client.post(f"/ng-rollout/{rollout_id}/v1/chat/completions", json=request)
    assert answer.status_code == 200
    return answer.content


def _check_garbled_row(row: dict[str, Any]) -> None:
    assert (row["status_code"], row["error_category"]) == (200, "capture_parse_error")
    assert row["stream_events_unparsed"] == 1
    # What could be read is kept: the content around the damaged (second of three) delta.
    text = CHAT["choices"][0]["message"]["content"]  # type: ignore[index]
    step = -(-len(text) // 3)
    assert row["response"]["choices"][0]["message"]["content"] == text[:step] + text[2 * step :]
    assert row["response"]["usage"]["total_tokens"] == 155


def test_a_damaged_stream_event_is_forwarded_counted_and_marked_by_the_proxy(
    proxy: Proxy, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="rollout_capture"):
        forwarded = _garbled_call(proxy.url, "garbled-p")
    assert forwarded == b"".join(garbled(chat_events(include_usage=True)))  # byte for byte
    (row,) = proxy.rows("garbled-p")
    _check_garbled_row(row)
    (warning,) = [r for r in caplog.records if "not JSON" in r.getMessage()]
    assert "garbled-p" in warning.getMessage()
    clean = httpx.post(
        f"{proxy.url}/ng-rollout/clean-p/v1/chat/completions",
        json={"model": "scripted", "messages": [], "stream": True},
    )
    assert clean.status_code == 200
    (row,) = proxy.rows("clean-p")
    assert row["error_category"] is None and "stream_events_unparsed" not in row


def test_a_damaged_stream_event_is_forwarded_counted_and_marked_by_the_middleware(
    middleware: Middleware,
) -> None:
    forwarded = _garbled_call(middleware.url, "garbled-m")
    assert forwarded == b"".join(garbled(chat_events(include_usage=True)))
    (row,) = middleware.store.read("garbled-m")
    _check_garbled_row(row)


def test_an_unparsed_event_does_not_hide_a_truncated_stream() -> None:
    from rollout_capture.producer.exchange import Exchange

    exchange = Exchange("r", "chat", server_name=None, max_body_bytes=1 << 20)
    exchange.response_started(200, [(b"content-type", b"text/event-stream")])
    events = garbled(chat_events(include_usage=True))
    exchange.body(b"".join(events[:-3]))  # the stream stops before its end
    exchange.end()
    row = exchange.row()
    assert (row["error_category"], row["stream_events_unparsed"]) == ("stream_truncated", 1)


# ---------------------------------------------------------------- 8: a status no server knows


class RawUpstream:
    """A model server writing its answer as raw bytes (uvicorn cannot send a status it does not know)."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.requests: list[bytes] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data and (more := conn.recv(65536)):
                    data += more
                head, _, body = data.partition(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                while len(body) < length and (more := conn.recv(65536)):
                    body += more
                self.requests.append(head + b"\r\n\r\n" + body)
                conn.sendall(self.answer)

    def close(self) -> None:
        self.sock.close()


ODD_BODY = b'{"error": {"message": "odd status"}}'
ODD_ANSWER = (
    b"HTTP/1.1 999 Odd\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
    % (len(ODD_BODY), ODD_BODY)
)


def test_an_unknown_upstream_status_is_a_502_naming_it_and_recorded_by_the_proxy(tmp_path: Path) -> None:
    upstream = RawUpstream(ODD_ANSWER)
    served = Proxy(upstream.url, str(tmp_path))
    try:
        with httpx.Client(base_url=served.url) as http:
            answer = http.post("/ng-rollout/odd-p/v1/chat/completions", json={"model": "scripted"})
            assert answer.status_code == 502 and "999" in answer.json()["error"]["message"]
            assert answer.json()["error"]["type"] == "upstream_invalid_status"
            passed = http.get("/v1/models")  # passed through uncaptured: the same answer, no row
            assert passed.status_code == 502 and "999" in passed.json()["error"]["message"]
        (row,) = served.rows("odd-p")
        assert (row["status_code"], row["error_category"]) == (999, "upstream_error")
        assert (row["response_source"], row["upstream_status_code"], row["local_response_reason"]) == (
            "local",  # the client got the proxy's 502, not the upstream's 999
            999,
            "upstream_invalid_status",
        )
        assert row["response"] == orjson.loads(ODD_BODY)
        assert served.store.claims(["odd-p"]) == {}
    finally:
        served.server.stop()
        upstream.close()


def test_an_unknown_app_status_is_a_502_naming_it_and_recorded_by_the_middleware(
    middleware: Middleware,
) -> None:
    with httpx.Client(base_url=middleware.url) as client:
        answer = client.post("/ng-rollout/odd-m/v1/chat/completions", json={"model": "scripted-status-999"})
    assert answer.status_code == 502 and "999" in answer.json()["error"]["message"]
    (row,) = middleware.store.read("odd-m")
    assert (row["status_code"], row["error_category"]) == (999, "upstream_error")
    assert row["response"] == orjson.loads(ODD_BODY)


# ---------------------------------------------------------------- 9: paths that leave the base path

ESCAPES = [
    b"/ng-rollout/r9/v1/../../tenant-b/v1/chat/completions",
    b"/ng-rollout/r9/v1/%2e%2E/%2E./tenant-b/v1/chat/completions",
    b"/ng-rollout/r9/v1/./chat/completions",
    b"/ng-rollout/r9/v1/chat%2fcompletions",
    b"/ng-rollout/r9/v1%5Cchat/completions",
    b"/ng-rollout/r9/v1\\chat/completions",  # a raw backslash: Windows-minded servers take it as "/"
    b"/ng-rollout/r9/v1/..",
]


@pytest.fixture(scope="module")
def tenant_proxy(
    scripted_upstream: tuple[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proxy]:
    served = Proxy(scripted_upstream[0] + "/tenant-a", str(tmp_path_factory.mktemp("tenant-a")))
    yield served
    served.server.stop()


@pytest.mark.parametrize(
    "path",
    [
        *ESCAPES,
        b"/v1/../../tenant-b/v1/models",
        b"/v1/models%2F..%2F..%2Fx",
        b"/v1\\..\\..\\tenant-b/v1/models",
    ],
)
def test_a_path_that_would_leave_the_base_path_is_refused_by_the_proxy(
    tenant_proxy: Proxy, scripted_upstream: tuple[str, Any], path: bytes
) -> None:
    app = scripted_upstream[1]
    calls = len(app.seen)
    status, body = post_raw(int(tenant_proxy.url.rsplit(":", 1)[1]), path, {"model": "scripted"})
    assert status == 400
    error = orjson.loads(body)["error"]
    assert error["type"] == "invalid_path" and repr(path.decode()) in error["message"]
    assert len(app.seen) == calls  # the upstream never saw it
    assert tenant_proxy.rows("r9") == []


@pytest.mark.parametrize("path", ESCAPES)
def test_a_path_with_dot_segments_or_encoded_slashes_is_refused_by_the_middleware(
    middleware: Middleware, path: bytes
) -> None:
    calls = len(middleware.app.seen)
    status, body = post_raw(middleware.port, path, {"model": "scripted"})
    assert status == 400 and orjson.loads(body)["error"]["type"] == "invalid_path"
    assert len(middleware.app.seen) == calls
    assert middleware.store.read("r9") == []
