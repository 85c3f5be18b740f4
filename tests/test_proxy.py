"""The capture proxy with real clients (openai, anthropic, httpx) in front of the scripted upstream:
captures, pass-through, faults, a client that leaves, S3, a killed and a stopped proxy."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest

from rollout_capture import (
    CaptureStore,
    await_model_call_capture_quiescence,
    merge_model_call_capture_into_record,
)
from rollout_capture.producer.proxy import CaptureProxy
from rollout_capture.producer.settings import ProxySettings

from .conftest import ROOT, S3, wait_for
from .support.producer_calls import DIALECTS, anthropic_client, check_row, openai_client, sdk_call
from .support.scripted_upstream import CHAT, CUT_ANSWERS, chat_events
from .support.servers import ThreadedServer

SERVER = "policy"


class Proxy:
    """A proxy served in this process, and the store it writes."""

    def __init__(self, upstream: str, capture_dir: str, **settings: Any) -> None:
        settings.setdefault("read_timeout_s", 1.0)  # the timeout tests' upstream falls silent
        self.settings = ProxySettings(
            upstream=upstream, capture_dir=capture_dir, server_name=SERVER, **settings
        )
        self.server = ThreadedServer(CaptureProxy(self.settings))
        self.url = self.server.url
        self.store = CaptureStore(capture_dir, storage_options=self.settings.storage_options)

    def rows(self, rollout_id: str) -> list[dict[str, Any]]:
        return self.store.read(rollout_id)

    def wait_rows(self, rollout_id: str, count: int = 1, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        while True:
            rows = self.rows(rollout_id)
            if len(rows) >= count or time.monotonic() > deadline:
                return rows
            time.sleep(0.02)


@pytest.fixture(scope="module")
def proxy(scripted_upstream: tuple[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    served = Proxy(scripted_upstream[0], str(tmp_path_factory.mktemp("proxy-captures")))
    yield served
    served.server.stop()


@pytest.fixture
def upstream_app(scripted_upstream: tuple[str, Any]) -> Any:
    return scripted_upstream[1]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("dialect", DIALECTS)
def test_sdk_calls_are_captured(proxy: Proxy, dialect: str, stream: bool) -> None:
    rollout_id = f"sdk-{dialect}-{int(stream)}"
    seen = sdk_call(proxy.url, rollout_id, dialect, stream)
    assert seen["tool"] == "get_weather"
    (row,) = proxy.rows(rollout_id)
    check_row(row, dialect, server_name=SERVER)
    assert proxy.store.claims([rollout_id]) == {}  # released once the row landed


def test_headers_query_and_body_pass_through_and_secrets_stay_out(proxy: Proxy, upstream_app: Any) -> None:
    body = b'{"model": "scripted",   "messages": [{"role": "user", "content": "caf\xc3\xa9"}]}'
    headers = {"authorization": "Bearer sk-secret-42", "x-api-key": "ak-secret-42", "x-trace": "t-1"}
    with httpx.Client(base_url=proxy.url) as client:
        answer = client.post(
            "/ng-rollout/pass-1/v1/chat/completions?api-version=7", content=body, headers=headers
        )
        assert answer.status_code == 200 and answer.json()["id"] == CHAT["id"]
        assert answer.headers["x-scripted"] == "1"  # response headers come back too
        got = upstream_app.seen[-1]
        assert (got["path"], got["query"], got["raw"]) == ("/v1/chat/completions", "api-version=7", body)
        assert got["headers"]["authorization"] == "Bearer sk-secret-42"
        assert got["headers"]["x-api-key"] == "ak-secret-42" and got["headers"]["x-trace"] == "t-1"
        models = client.get("/ng-rollout/pass-1/v1/models?x=1", headers=headers)  # not a model call
        assert models.json()["path"] == "/v1/models" and upstream_app.seen[-1]["query"] == "x=1"
        assert client.get("/v1/models").json()["path"] == "/v1/models"  # no rollout prefix
    (row,) = proxy.rows("pass-1")
    assert row["request"]["messages"][0]["content"] == "café"
    stored = b"".join(
        p.read_bytes() for p in Path(proxy.settings.capture_dir).rglob("pass-1*") if p.is_file()
    )
    for secret in (b"sk-secret-42", b"ak-secret-42", b"t-1", b"authorization"):
        assert secret not in stored


def test_chat_usage_is_asked_for_upstream_and_hidden_from_the_client(proxy: Proxy, upstream_app: Any) -> None:
    request = {"model": "scripted", "messages": [], "stream": True}
    with httpx.Client(base_url=proxy.url) as client:
        got = client.post("/ng-rollout/usage-1/v1/chat/completions", json=request)
    assert got.content == b"".join(chat_events(include_usage=False))  # exactly as without the proxy
    assert upstream_app.seen[-1]["body"]["stream_options"] == {"include_usage": True}
    (row,) = proxy.rows("usage-1")
    assert row["request"] == request and row["response"]["usage"] == CHAT["usage"]

    asked = openai_client(proxy.url, "usage-2").chat.completions.create(
        model="scripted", messages=[], stream=True, stream_options={"include_usage": True}
    )
    chunks = list(asked)
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 155


def test_a_bad_rollout_id_is_refused_and_nothing_is_written(proxy: Proxy, upstream_app: Any) -> None:
    before = sorted(os.listdir(proxy.settings.capture_dir))
    calls = len(upstream_app.seen)
    with httpx.Client(base_url=proxy.url) as client:
        for path in ("/ng-rollout/..%2F..%2Fetc/v1/chat/completions", "/ng-rollout/a%20b/v1/messages"):
            answer = client.post(path, json={"model": "scripted"})
            assert answer.status_code == 400
            assert "invalid rollout id" in answer.json()["error"]["message"]
    assert "'../../etc'" in client_error(proxy.url, "/ng-rollout/..%2F..%2Fetc/v1/responses")
    assert sorted(os.listdir(proxy.settings.capture_dir)) == before
    assert len(upstream_app.seen) == calls


def client_error(base: str, path: str) -> str:
    with httpx.Client(base_url=base) as client:
        return str(client.post(path, json={}).json()["error"]["message"])


def test_upstream_errors_pass_through_and_are_classified(proxy: Proxy) -> None:
    with pytest.raises(openai.RateLimitError):
        openai_client(proxy.url, "err-1").chat.completions.create(model="scripted-429", messages=[])
    with pytest.raises(openai.InternalServerError):
        openai_client(proxy.url, "err-1").responses.create(model="scripted-500", input="x")
    with pytest.raises(anthropic.BadRequestError) as caught:
        anthropic_client(proxy.url, "err-1").messages.create(model="scripted-400", max_tokens=1, messages=[])
    assert caught.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    rows = proxy.rows("err-1")
    assert [(r["status_code"], r["error_category"]) for r in rows] == [
        (429, "rate_limit"),
        (500, "upstream_error"),
        (400, "client_error"),
    ]
    assert rows[0]["response"]["error"]["message"] == "scripted 429"
    # Who answered (NeMo Gym 0.7.0's facts): the upstream, each status kept, 400 the lowest of them.
    assert [[row[k] for k in FACTS] for row in rows] == [[True, "upstream", s, None] for s in (429, 500, 400)]


def test_an_unreachable_upstream_is_a_502_and_a_slow_one_a_504(proxy: Proxy, tmp_path: Path) -> None:
    with socketless_port() as port:
        dead = Proxy(f"http://127.0.0.1:{port}", str(tmp_path), connect_timeout_s=2.0)
    try:
        with pytest.raises(openai.InternalServerError) as caught:
            openai_client(dead.url, "down-1").chat.completions.create(model="scripted", messages=[])
        assert caught.value.status_code == 502 and "unreachable" in str(caught.value)
        (row,) = dead.rows("down-1")
        assert (row["status_code"], row["error_category"], row["response"]) == (None, "connection", None)
        assert row["request"]["model"] == "scripted"
        # Who answered (NeMo Gym 0.7's facts, issue 34): the proxy itself, having tried the upstream.
        assert [row[k] for k in FACTS] == [True, "local", None, "upstream_connection_error"]
    finally:
        dead.server.stop()
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        answer = client.post("/ng-rollout/slow-1/v1/messages", json={"model": "scripted-hang"})
    assert answer.status_code == 504 and answer.json()["error"]["type"] == "upstream_timeout"
    (row,) = proxy.rows("slow-1")
    assert (row["status_code"], row["error_category"]) == (None, "timeout")
    assert [row[k] for k in FACTS] == [True, "local", None, "upstream_timeout"]
    with pytest.raises(openai.RateLimitError):  # an error the upstream answered is the upstream's
        openai_client(proxy.url, "busy-1").chat.completions.create(model="scripted-429", messages=[])
    (row,) = proxy.rows("busy-1")
    assert [row[k] for k in FACTS] == [True, "upstream", 429, None]
    # A success keeps no status (NeMo Gym's vllm_model keeps the upstream's only when an error).
    openai_client(proxy.url, "fine-1").chat.completions.create(model="scripted", messages=[])
    (row,) = proxy.rows("fine-1")
    assert [row[k] for k in FACTS] == [True, "upstream", None, None]


FACTS = ("upstream_attempted", "response_source", "upstream_status_code", "local_response_reason")


class socketless_port:
    """A loopback port nothing listens on."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        return None


def test_streams_cut_short_are_stream_truncated(proxy: Proxy) -> None:
    chunks = list(
        openai_client(proxy.url, "cut-1").chat.completions.create(
            model="scripted-cut", messages=[], stream=True
        )
    )
    assert chunks  # what the upstream sent before it stopped
    with pytest.raises((httpx.HTTPError, openai.APIError)):  # the upstream dropped the connection: so do we
        list(
            openai_client(proxy.url, "cut-1").responses.create(model="scripted-abort", input="x", stream=True)
        )
    rows = proxy.wait_rows("cut-1", 2)
    assert [(r["status_code"], r["error_category"]) for r in rows] == [(200, "stream_truncated")] * 2
    assert rows[0]["response"]["choices"][0]["message"]["reasoning_content"]  # what came is kept
    assert rows[1]["response"]["id"] == "resp_scripted"


def test_a_body_that_is_not_json_is_kept_raw(proxy: Proxy) -> None:
    with httpx.Client(base_url=proxy.url) as client:
        answer = client.post("/ng-rollout/text-1/v1/responses", content=b"model=scripted-text")
        assert answer.status_code == 200
        answer = client.post("/ng-rollout/text-1/v1/responses", json={"model": "scripted-text"})
        assert answer.text == "upstream said something that is not JSON"
    rows = proxy.rows("text-1")
    assert rows[0]["request"] is None and rows[0]["request_raw"] == "model=scripted-text"
    assert rows[1]["response"] is None and rows[1]["response_raw"] == answer.text
    assert rows[1]["error_category"] == "capture_parse_error"


def test_oversized_bodies_are_forwarded_whole_and_cut_in_the_row(
    scripted_upstream: tuple[str, Any], tmp_path: Path
) -> None:
    url, app = scripted_upstream
    small = Proxy(url, str(tmp_path), max_body_bytes=4096)
    try:
        request = {"model": "scripted-big", "messages": [{"role": "user", "content": "y" * 50_000}]}
        body = orjson.dumps(request)
        with httpx.Client(base_url=small.url) as client:
            answer = client.post("/ng-rollout/big-1/v1/chat/completions", content=body)
        assert answer.status_code == 200 and len(answer.json()["padding"]) == 200_000
        assert app.seen[-1]["raw"] == body
        (row,) = small.rows("big-1")
        assert row["request_truncated"] is True and row["request_raw"] == body[:4096].decode()
        assert row["response_truncated"] is True and row["response"] is None
        # A good answer over the cap is no failed call: its own outcome stands, the row says it is cut.
        assert (row["status_code"], row["error_category"]) == (200, None)
        assert len(row["response_raw"]) == 4096
    finally:
        small.server.stop()


def test_a_client_that_leaves_mid_stream_still_leaves_its_row(
    scripted_upstream: tuple[str, Any], upstream_app: Any, tmp_path: Path
) -> None:
    # Patient with the upstream: it waits at its gate as long as the test needs, however loaded.
    patient = Proxy(scripted_upstream[0], str(tmp_path), read_timeout_s=60.0)
    request = {"model": "scripted-gated-gone-1", "messages": [], "stream": True}
    try:
        with (
            httpx.Client(base_url=patient.url) as client,
            client.stream("POST", "/ng-rollout/gone-1/v1/chat/completions", json=request) as answer,
        ):
            chunks = answer.iter_raw()  # held: a discarded iterator closes the connection at once
            first = next(chunks)
            assert first.startswith(b"data: ")
            # Forwarded as it came: the client has it while the upstream waits at its gate.
            assert patient.rows("gone-1") == [] and patient.store.live_claims("gone-1")
        (row,) = patient.wait_rows("gone-1")
        upstream_app.gate("gone-1").set()
        # Its client left: cancelled, as NeMo Gym's model servers (which cancel the call) record it.
        assert (row["status_code"], row["error_category"]) == (200, "cancelled")
        assert row["response"]["id"] == CHAT["id"]  # what had arrived
        wait_for(lambda: patient.store.claims(["gone-1"]) == {})  # released just after the row lands
    finally:
        upstream_app.gate("gone-1").set()
        patient.server.stop()


def test_the_upstream_client_captures_streams_and_decodes_what_came_compressed(
    scripted_upstream: tuple[str, Any], tmp_path: Path
) -> None:
    served = Proxy(scripted_upstream[0], str(tmp_path))
    try:
        seen = sdk_call(served.url, "cl-1", "chat", True)
        assert seen["tool"] == "get_weather"
        with httpx.Client(base_url=served.url) as http:
            captured = http.post("/ng-rollout/cl-2/v1/chat/completions", json={"model": "scripted-gzip"})
            passed = http.post("/v1/chat/completions", json={"model": "scripted-gzip"})
        # Captured: forwarded decoded, as the row holds it. Passed through: as it came.
        assert "content-encoding" not in captured.headers and captured.json()["id"] == CHAT["id"]
        assert passed.headers["content-encoding"] == "gzip" and passed.json()["id"] == CHAT["id"]
        (row,) = served.rows("cl-2")
        assert (row["response"]["id"], row["error_category"]) == (CHAT["id"], None)
        check_row(served.rows("cl-1")[0], "chat", server_name=SERVER)
    finally:
        served.server.stop()


def test_a_verifier_names_its_invocation_in_a_header(proxy: Proxy) -> None:
    judge = openai_client(
        proxy.url, "judge-1", default_headers={"X-Rollout-Capture-Verifier-Invocation-Id": "v-7"}
    )
    judge.chat.completions.create(model="scripted", messages=[])
    (row,) = proxy.rows("judge-1")
    assert row["verifier_invocation_id"] == "v-7"


def _calls_on_s3(upstream: str, s3: S3, **settings: Any) -> list[str]:
    """One streamed call of each dialect through a proxy writing to S3; the keys it left there."""
    on_s3 = Proxy(upstream, s3.url("caps"), storage_options=s3.storage_options, **settings)
    try:
        for dialect in DIALECTS:
            sdk_call(on_s3.url, "s3-1", dialect, stream=True)
        rows = on_s3.rows("s3-1")
        assert [r["dialect"] for r in rows] == list(DIALECTS)
        for row, dialect in zip(rows, DIALECTS, strict=True):
            check_row(row, dialect, server_name=SERVER)
        assert on_s3.store.claims(["s3-1"]) == {}  # every claim released with its row
    finally:
        on_s3.server.stop()
    return sorted(k.split("/caps/", 1)[1] for k in s3.fs().find(f"{s3.bucket}/caps"))


def test_the_proxy_writes_the_journal_on_s3_unless_told_otherwise(
    scripted_upstream: tuple[str, Any], s3: S3
) -> None:
    """Spec 2: on an object store a producer groups its calls' claims and rows into journal commits."""
    keys = _calls_on_s3(scripted_upstream[0], s3)
    assert keys and all(k.startswith("_journal/") for k in keys)  # no per-call object, no claim file


def test_the_proxy_writes_objects_on_s3(scripted_upstream: tuple[str, Any], s3: S3) -> None:
    keys = _calls_on_s3(scripted_upstream[0], s3, layout="objects")
    assert keys == [f"s3-1.capture/00000000000{n}.json" for n in range(3)]  # no claims left


# ---------------------------------------------------------------- a real proxy process


class Spawned:
    """A ``rollout-capture proxy`` process: its URL, and what it logged (drained, so it never blocks)."""

    def __init__(self, upstream: str, capture_dir: Path, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rollout_capture.cli",
                "proxy",
                "--upstream",
                upstream,
                "--capture-dir",
                str(capture_dir),
                "--port",
                "0",
                "--log-level",
                "warning",
                *extra,
            ],
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        assert self.proc.stderr is not None
        line = self.proc.stderr.readline()
        assert " on http://" in line, line
        self.url = line.split(" on ", 1)[1].split(" ", 1)[0]
        self.log: list[str] = []
        self._drain = threading.Thread(target=self._read, args=(self.proc.stderr,), daemon=True)
        self._drain.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self.log.append(line)

    def workers(self) -> list[int]:
        """The pids of its worker processes (children running multiprocessing's spawn)."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                command = (entry / "cmdline").read_bytes()
            except (OSError, IndexError, ValueError):
                continue
            if parent == self.proc.pid and b"spawn_main" in command:
                found.append(int(entry.name))
        return sorted(found)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def spawn_proxy(upstream: str, capture_dir: Path, *extra: str) -> tuple[subprocess.Popen[str], str]:
    spawned = Spawned(upstream, capture_dir, *extra)
    return spawned.proc, spawned.url


def stream_in_background(url: str, rollout_id: str, model: str) -> tuple[threading.Thread, dict[str, Any]]:
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            with httpx.Client(base_url=url, timeout=30) as client:
                got = client.post(
                    f"/ng-rollout/{rollout_id}/v1/chat/completions",
                    json={"model": model, "messages": [], "stream": True},
                )
                outcome["body"] = got.content
        except httpx.HTTPError as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def kill_mid_stream(
    scripted_upstream: tuple[str, Any],
    proc: subprocess.Popen[str],
    url: str,
    store: CaptureStore,
    gate: str,
    while_claimed: Callable[[list[Any]], None] = lambda claims: None,
) -> dict[str, Any]:
    """SIGKILL a proxy while it streams a call of rollout 7-0 held at the upstream's ``gate``
    (``while_claimed`` looks at the live claims first); what the client got."""
    try:
        thread, outcome = stream_in_background(url, "7-0", f"scripted-gated-{gate}")
        while_claimed(wait_for(lambda: store.live_claims("7-0")))
        proc.send_signal(signal.SIGKILL)  # mid-stream: the upstream waits at its gate
        proc.wait(10)
        thread.join(30)
    finally:
        scripted_upstream[1].gate(gate).set()
        if proc.poll() is None:
            proc.kill()
    return outcome


def refused(url: str) -> bool:
    """Whether a new connection to the server is refused (it stopped listening)."""
    import socket

    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except ConnectionRefusedError:
        return True
    except (ConnectionResetError, ConnectionAbortedError):
        return False  # a listener closing as we connected: not refused yet, asked again next poll
    return False


async def test_a_killed_proxy_leaves_claims_that_expire_as_abandoned(
    scripted_upstream: tuple[str, Any], tmp_path: Path
) -> None:
    proc, url = spawn_proxy(scripted_upstream[0], tmp_path, "--claim-ttl", "1")
    store = CaptureStore(tmp_path)
    outcome = kill_mid_stream(scripted_upstream, proc, url, store, "killed")
    assert "error" in outcome  # the client saw its connection die
    record = {"_ng_task_index": 7, "_ng_rollout_index": 0}
    assert await await_model_call_capture_quiescence("7-0", [store], timeout_s=15, poll_s=0.05)
    gaps = merge_model_call_capture_into_record(record, [store])["ng_model_call_capture"]["gaps"]
    assert {"code": "model_call_capture_claim_abandoned", "detail": "count=1"} in gaps


@pytest.mark.parametrize("workers", [1, 2])
def test_a_stopped_proxy_finishes_the_calls_in_flight(
    scripted_upstream: tuple[str, Any], tmp_path: Path, workers: int
) -> None:
    proc, url = spawn_proxy(scripted_upstream[0], tmp_path, "--workers", str(workers))
    store = CaptureStore(tmp_path)
    rollout_id, gate = f"8-{workers}", f"stopped-{workers}"
    try:
        thread, outcome = stream_in_background(url, rollout_id, f"scripted-gated-{gate}")
        wait_for(lambda: store.live_claims(rollout_id))
        proc.send_signal(signal.SIGTERM)  # mid-stream: the upstream waits at its gate
        wait_for(lambda: refused(url))  # every worker stopped accepting; the call goes on
        scripted_upstream[1].gate(gate).set()
        thread.join(30)
        assert proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once stopped
    finally:
        scripted_upstream[1].gate(gate).set()
        if proc.poll() is None:
            proc.kill()
    assert outcome.get("body") == b"".join(chat_events(include_usage=False))
    (row,) = store.read(rollout_id)
    assert (row["status_code"], row["error_category"]) == (200, None)
    assert store.claims([rollout_id]) == {}


# ---------------------------------------------------------------- several worker processes


@pytest.fixture(scope="module")
def two_workers(
    scripted_upstream: tuple[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Spawned, CaptureStore]]:
    root = tmp_path_factory.mktemp("two-workers")
    spawned = Spawned(scripted_upstream[0], root, "--workers", "2", "--server-name", SERVER)
    try:
        yield spawned, CaptureStore(root)
    finally:
        spawned.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_two_worker_proxy_captures_sdk_calls(
    two_workers: tuple[Spawned, CaptureStore], stream: bool
) -> None:
    spawned, store = two_workers
    wait_for(lambda: len(spawned.workers()) == 2)  # spawned just after the address is announced
    for dialect in DIALECTS:
        rollout_id = f"w2-{dialect}-{int(stream)}"
        assert sdk_call(spawned.url, rollout_id, dialect, stream)["tool"] == "get_weather"
        (row,) = store.read(rollout_id)
        check_row(row, dialect, server_name=SERVER)
        assert store.claims([rollout_id]) == {}


def test_concurrent_calls_of_one_rollout_through_two_workers_leave_one_row_each(
    two_workers: tuple[Spawned, CaptureStore], scripted_upstream: tuple[str, Any]
) -> None:
    """Both workers append to the same rollout's capture at once: flock'd appends, per-call claims."""
    spawned, store = two_workers
    rollout_id, gate, streams, plain = "w2-same-0", "same-2w", 16, 8
    try:
        # Streams held at the upstream's gate, each on a connection of its own: the kernel
        # spreads the connections over both workers' sockets.
        held = [
            stream_in_background(spawned.url, rollout_id, f"scripted-gated-{gate}") for _ in range(streams)
        ]
        wait_for(lambda: len(store.live_claims(rollout_id)) == streams)
        assert len({claim.pid for claim in store.live_claims(rollout_id)}) == 2  # both hold calls
        # Meanwhile whole calls of every dialect land their rows beside the open ones.
        done = [
            threading.Thread(target=sdk_call, args=(spawned.url, rollout_id, DIALECTS[n % 3], False))
            for n in range(plain)
        ]
        for thread in done:
            thread.start()
        for thread in done:
            thread.join(30)
        scripted_upstream[1].gate(gate).set()
        for thread, _ in held:
            thread.join(30)
    finally:
        scripted_upstream[1].gate(gate).set()
    expected = b"".join(chat_events(include_usage=False))
    assert all(outcome.get("body") == expected for _, outcome in held)
    snapshot = store.snapshot(rollout_id)
    assert snapshot.damaged == [] and not snapshot.incomplete
    rows = store.read(rollout_id)
    assert len(rows) == streams + plain
    assert len({row["model_call_id"] for row in rows}) == streams + plain
    assert all((row["status_code"], row["error_category"]) == (200, None) for row in rows)
    dialects = ["chat"] * streams + [DIALECTS[n % 3] for n in range(plain)]
    assert sorted(row["dialect"] for row in rows) == sorted(dialects)
    assert store.claims([rollout_id]) == {}


def test_a_worker_that_dies_is_reported_and_replaced(two_workers: tuple[Spawned, CaptureStore]) -> None:
    spawned, store = two_workers
    wait_for(lambda: len(spawned.workers()) == 2)
    before = spawned.workers()
    os.kill(before[0], signal.SIGKILL)
    wait_for(lambda: any("died (signal SIGKILL)" in line for line in spawned.log))
    wait_for(lambda: len(spawned.workers()) == 2 and spawned.workers() != before)
    for n in range(4):  # fresh connections, whichever worker takes them
        sdk_call(spawned.url, "w2-after-0", "chat", stream=n % 2 == 1)
    assert len(store.read("w2-after-0")) == 4


def test_workers_whose_parent_is_killed_finish_their_calls_and_stop(
    scripted_upstream: tuple[str, Any], tmp_path: Path
) -> None:
    spawned = Spawned(scripted_upstream[0], tmp_path, "--workers", "2")
    store = CaptureStore(tmp_path)
    try:
        thread, outcome = stream_in_background(spawned.url, "10-0", "scripted-gated-orphaned")
        wait_for(lambda: store.live_claims("10-0"))
        workers = spawned.workers()
        spawned.proc.send_signal(signal.SIGKILL)  # the parent cannot pass a stop on: they notice
        spawned.proc.wait(10)
        wait_for(lambda: refused(spawned.url))
        scripted_upstream[1].gate("orphaned").set()
        thread.join(30)
        wait_for(lambda: not [pid for pid in workers if running(pid)])
    finally:
        scripted_upstream[1].gate("orphaned").set()
        spawned.stop()
    assert outcome.get("body") == b"".join(chat_events(include_usage=False))
    (row,) = store.read("10-0")
    assert (row["status_code"], row["error_category"]) == (200, None)
    assert store.claims(["10-0"]) == {}


def running(pid: int) -> bool:
    """Whether a process is there and not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_supervisor_restarts_a_dead_worker_and_gives_up_on_one_that_cannot_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from rollout_capture.producer import workers

    from .support.spawned import supervised

    monkeypatch.setattr(workers, "RESTART_DELAY_S", 0.01)
    with pytest.raises(workers.WorkerStartupFailed, match=r"worker 0 \(pid \d+\) could not start"):
        workers.supervise(supervised, lambda index: (index, str(tmp_path)), 2, stop_timeout_s=30)
    died = [r.getMessage() for r in caplog.records if "died" in r.getMessage()]
    assert len(died) == 1 and "worker 0" in died[0] and "exit code 1" in died[0]
    # The other one was stopped (and waited for) before the raise.
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("worker-")]


def test_the_cli_refuses_bad_settings_with_exit_code_2(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from rollout_capture.cli.app import app

    runner = CliRunner()
    bad = runner.invoke(app, ["proxy", "--upstream", "ftp://nope", "--capture-dir", str(tmp_path)])
    assert bad.exit_code == 2 and "upstream must be an http" in bad.output
    secret = ["proxy", "--upstream", "http://x", "-c", str(tmp_path), "--storage-options", '{"secret": "s"}']
    assert runner.invoke(app, secret).exit_code == 2
    none = ["proxy", "--upstream", "http://x", "-c", str(tmp_path), "--workers", "0"]
    assert runner.invoke(app, none).exit_code == 2


@pytest.mark.parametrize("where", ["no such bucket", "under a file"])
def test_a_proxy_that_cannot_write_its_capture_root_exits_2_before_serving(
    s3: S3, tmp_path: Path, where: str
) -> None:
    """Issue 26: exit 2 naming the root, no traceback, and no port ever served (no call accepted)."""
    (tmp_path / "file").write_text("not a folder")
    root = (
        f"s3://no-such-bucket-{os.getpid()}/caps"
        if where == "no such bucket"
        else str(tmp_path / "file" / "x")
    )
    command = [sys.executable, "-m", "rollout_capture.cli", "proxy", "--upstream", "http://127.0.0.1:9"]
    command += [
        "--capture-dir",
        root,
        "--storage-options",
        orjson.dumps(s3.storage_options).decode(),
        "--port",
        "0",
    ]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT)
    assert proc.stderr is not None
    said = ""
    try:
        while line := proc.stderr.readline():  # until it exits, or announces the port it serves
            said += line
            assert " on http" not in line, f"the proxy started serving: {said}"
        assert proc.wait(60) == 2, said
    finally:
        proc.kill()
        proc.wait(30)
        proc.stderr.close()
    assert f"capture root {root} cannot be written" in said and "Traceback" not in said


async def test_the_proxys_connections_have_nagle_off() -> None:
    """A pre-bound socket must say it is TCP, or asyncio leaves Nagle on (40 ms stalls)."""
    import asyncio
    import socket

    from rollout_capture.producer.server import bind_listener

    sock = bind_listener("127.0.0.1", 0)
    nodelay: list[int] = []

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nodelay.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(accepted, sock=sock)
    async with server:
        _, writer = await asyncio.open_connection(*sock.getsockname())
        async with asyncio.timeout(30):  # a deadline: fails, never hangs
            while not nodelay:
                await asyncio.sleep(0.01)
        writer.close()
    assert nodelay == [1]


def _store_noting_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[CaptureStore, list[str]]:
    """A store that notes the thread each row is staged on (the loop's, or a writer thread's)."""

    store = CaptureStore(tmp_path)
    staged_on: list[str] = []
    stage = store.record_staged

    def spy(rollout_id: str, row: dict[str, Any]) -> Any:
        staged_on.append(threading.current_thread().name)
        return stage(rollout_id, row)

    monkeypatch.setattr(store, "record_staged", spy)
    return store, staged_on


async def _two_calls(capture: Any, rollout_id: str) -> None:
    """Two calls of one rollout through ``capture``, each claimed then recorded; then closed."""
    try:
        for call in ("c1", "c2"):
            claim = await capture.claim(rollout_id, call)
            assert await capture.record(rollout_id, {"model_call_id": call}, release=claim)
    finally:
        capture.close()


async def test_a_slow_disk_moves_capture_writes_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    from rollout_capture.producer import writer

    monkeypatch.setattr(writer, "INLINE_LIMIT_S", 0.0)  # every write on the loop counts as slow
    monkeypatch.setattr(writer, "_context_switches", lambda: None)  # even if preempted meanwhile
    store, staged_on = _store_noting_threads(tmp_path, monkeypatch)
    capture = writer.CaptureWriter(store, claim_ttl_s=60)
    await _two_calls(capture, "slow-1")
    assert staged_on[0] != threading.current_thread().name  # the first claim was slow: all threaded after
    assert [r["model_call_id"] for r in store.read("slow-1")] == ["c1", "c2"]
    assert store.claims(["slow-1"]) == {}


async def test_a_loop_only_preempted_keeps_capture_writes_on_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A busy machine that takes the loop's core mid-write (an involuntary switch, no wait of
    its own) is no slow disk: writes stay on the loop (each thread hop costs CPU per call)."""
    import itertools

    from rollout_capture.producer import writer

    monkeypatch.setattr(writer, "INLINE_LIMIT_S", 0.0)  # every write on the loop counts as slow
    preemptions = itertools.count()
    monkeypatch.setattr(writer, "_context_switches", lambda: (7, next(preemptions)))  # only preempted
    store, staged_on = _store_noting_threads(tmp_path, monkeypatch)
    capture = writer.CaptureWriter(store, claim_ttl_s=60)
    await _two_calls(capture, "busy-1")
    assert staged_on == [threading.current_thread().name] * 2
    assert [r["model_call_id"] for r in store.read("busy-1")] == ["c1", "c2"]
    assert store.claims(["busy-1"]) == {}


async def test_capture_writes_moved_to_threads_go_back_on_the_loop_after_a_while(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One slow moment of a local disk does not cost a thread hop per call for good: after the
    wait, writes are tried on the loop again."""

    from rollout_capture.producer import writer

    monkeypatch.setattr(writer, "RETRY_INLINE_S", 0.0)  # the wait is over at once
    monkeypatch.setattr(writer, "_context_switches", lambda: None)  # a slow write counts, preempted or not
    store, staged_on = _store_noting_threads(tmp_path, monkeypatch)
    capture = writer.CaptureWriter(store, claim_ttl_s=60)
    loop_thread = threading.current_thread().name
    try:
        monkeypatch.setattr(writer, "INLINE_LIMIT_S", 0.0)  # the disk is slow: the claim moves writes
        claim = await capture.claim("back-1", "c1")
        assert capture.claims_in_background  # on threads now
        monkeypatch.setattr(writer, "INLINE_LIMIT_S", 3600.0)  # fast again
        assert await capture.record("back-1", {"model_call_id": "c1"}, release=claim)
        assert not capture.claims_in_background  # back on the loop
        claim = await capture.claim("back-1", "c2")
        assert await capture.record("back-1", {"model_call_id": "c2"}, release=claim)
    finally:
        capture.close()
    assert staged_on == [loop_thread, loop_thread]
    assert [r["model_call_id"] for r in store.read("back-1")] == ["c1", "c2"]
    assert store.claims(["back-1"]) == {}


def test_a_wait_of_the_thread_itself_is_not_taken_for_preemption() -> None:
    import time

    from rollout_capture.producer.writer import _context_switches, _only_preempted

    before = _context_switches()
    time.sleep(0.01)  # a wait of its own, as a disk that blocks the loop is: a voluntary switch
    assert not _only_preempted(before)
    assert not _only_preempted(None)  # nothing known (no RUSAGE_THREAD): a slow write is a slow disk


@pytest.mark.parametrize(("model", "stream", "expected"), CUT_ANSWERS)
def test_an_answer_cut_off_is_classified_as_the_middleware_does(
    proxy: Proxy, model: str, stream: bool, expected: tuple[int, str]
) -> None:
    rollout_id = f"cut-off-{model}"
    request = {"model": model, "messages": [], "stream": stream}
    # The upstream dropped the connection: so does the producer.
    with httpx.Client(base_url=proxy.url) as client, contextlib.suppress(httpx.HTTPError):
        client.post(f"/ng-rollout/{rollout_id}/v1/chat/completions", json=request).read()
    (row,) = proxy.wait_rows(rollout_id)
    assert (row["status_code"], row["error_category"]) == expected
    assert proxy.store.claims([rollout_id]) == {}
