"""A tiny OTLP/HTTP receiver: an HTTP server thread on a loopback port that records each POST's
path, headers and body and answers 200 (the trace export's tests, without Phoenix), or answers
as a test scripts it: a redirect, a status line trickled a byte at a time, a body too big to read,
a reason phrase of 60 kB, a 413 past a size. It may speak TLS (a private CA's certificate, a client
certificate required), keep connections alive only to close each after its answer (a server whose
keep-alive ran out), or listen on a port of the test's choosing (a proxy on port 80)."""

from __future__ import annotations

import http.server
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Received:
    """One POST: its path, its headers (names lower-cased: HTTP's are case-blind), its body."""

    path: str
    headers: dict[str, str]
    body: bytes


Script = Callable[["OtlpReceiver", int, Received, Any], bool]
"""``(receiver, index of the request, the request, its handler) -> answered``: a script writes a raw
answer on ``handler.wfile`` and returns True, or returns False for the receiver's own answer."""


class OtlpReceiver(http.server.ThreadingHTTPServer):
    """Records every request in ``received``; ``url`` is its base URL (``/v1/traces`` is added)."""

    daemon_threads = True

    def __init__(
        self,
        refuse: int | None = None,
        *,
        status: int = 200,
        then: list[int] | None = None,
        retry_after: str | None = None,
        script: Script | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: ssl.SSLContext | None = None,
        close_after_answer: bool = False,
    ) -> None:
        """Every request answered ``status``; with ``refuse``, a request carrying spans is answered
        that; with ``then``, the first request (the probe) gets 200 and the next ones ``then``'s;
        ``retry_after`` goes with every refusal as its ``Retry-After`` header; with ``script``,
        whatever it writes (see :data:`Script`). ``tls``: its context (the handshake in the
        request's thread); ``close_after_answer``: answers are HTTP/1.1 (kept alive, as far as the
        client knows) and the connection is closed after each, unannounced."""
        self.received: list[Received] = []
        self.refuse, self.status, self.then, self.script = refuse, status, list(then or []), script
        self.retry_after = retry_after
        self.stopping = threading.Event()
        self.scripted: set[int] = set()
        """Requests a script answered (their spans did not land)."""
        self.sent_bytes = 0
        """Bytes of body a script managed to write before the client hung up (``huge_body``)."""
        self.hung_up = threading.Event()
        """Set when a script's write found the client gone."""
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1" if close_after_answer else "HTTP/1.0"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {name.lower(): value for name, value in self.headers.items()}
                request = Received(self.path, headers, body)
                receiver.received.append(request)
                index = len(receiver.received) - 1
                if receiver.script is not None and receiver.script(receiver, index, request, self):
                    receiver.scripted.add(index)
                    self.close_connection = True
                    return
                status = receiver.answer(body)
                self.send_response(status)
                if receiver.retry_after is not None and status >= 400:
                    self.send_header("Retry-After", receiver.retry_after)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()
                if close_after_answer:
                    self.close_connection = True  # no "Connection: close": the client finds out

            def do_GET(self) -> None:  # a client following a redirect may turn the POST into a GET
                headers = {name.lower(): value for name, value in self.headers.items()}
                receiver.received.append(Received(self.path, headers, b""))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__((host, port), Handler)
        if tls is not None:
            self.socket = tls.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)
        self.url = f"{'https' if tls else 'http'}://{host}:{self.server_address[1]}"
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client refusing our certificate, or hanging up: nothing to print."""

    @property
    def bodies(self) -> list[bytes]:
        """Each request's body, in the order they came."""
        return [request.body for request in self.received]

    def answer(self, body: bytes) -> int:
        """The status of the request just received."""
        if self.then and len(self.received) > 1:
            return self.then.pop(0)
        return self.refuse if self.refuse and body else self.status

    def spans(self) -> list[Any]:
        """Every span received and not refused by a script, decoded (the probe's body is empty)."""
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        out: list[Any] = []
        for index, request in enumerate(self.received):
            if index in self.scripted:
                continue
            decoded = ExportTraceServiceRequest.FromString(request.body)
            for resource in decoded.resource_spans:
                for scope in resource.scope_spans:
                    out.extend(scope.spans)
        return out

    def resources(self) -> list[dict[str, Any]]:
        """The resource attributes of every batch of spans received (string values)."""
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        out = []
        for request in self.received:
            for resource in ExportTraceServiceRequest.FromString(request.body).resource_spans:
                out.append({a.key: a.value.string_value for a in resource.resource.attributes})
        return out

    def stop(self) -> None:
        self.stopping.set()
        self.shutdown()
        self.server_close()


# ---------------------------------------------------------------------- scripted answers


def write_raw(receiver: OtlpReceiver, handler: Any, data: bytes) -> bool:
    """Write ``data`` to the client; False once it has hung up (the script then stops)."""
    try:
        handler.wfile.write(data)
        handler.wfile.flush()
    except OSError:  # BrokenPipe, ConnectionReset: the client gave up, as it should
        receiver.hung_up.set()
        return False
    return True


def answer_raw(receiver: OtlpReceiver, handler: Any, status: str, content_type: str, body: bytes) -> bool:
    """Write a whole answer (``status`` as ``"200 OK"``); True: a script's "answered"."""
    head = f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
    write_raw(receiver, handler, head.encode() + body)
    return True


def redirect(status: int, location: str, after: int = 0) -> Script:
    """Requests from the ``after``-th on answered ``status`` with ``Location: location``."""

    def script(receiver: OtlpReceiver, index: int, request: Received, handler: Any) -> bool:
        if index < after:
            return False
        write_raw(
            receiver,
            handler,
            f"HTTP/1.1 {status} Moved\r\nLocation: {location}\r\nContent-Length: 0\r\n"
            "Connection: close\r\n\r\n".encode(),
        )
        return True

    return script


def trickle(every_s: float, after: int = 0) -> Script:
    """From the ``after``-th request on, a 200's status line and headers a byte every ``every_s``,
    never ending (until the client hangs up or the receiver stops)."""

    def script(receiver: OtlpReceiver, index: int, request: Received, handler: Any) -> bool:
        if index < after:
            return False
        answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nX-Pad: " + b"a" * 10_000_000
        for i in range(len(answer)):
            if not write_raw(receiver, handler, answer[i : i + 1]) or receiver.stopping.wait(every_s):
                break
        return True

    return script


def huge_body(status: int, size: int, after: int = 0, reason: str = "Bad Request") -> Script:
    """From the ``after``-th request on, ``status`` with a body of ``size`` bytes (written as it
    goes, never held: ``receiver.sent_bytes`` counts what the client took before hanging up)."""

    def script(receiver: OtlpReceiver, index: int, request: Received, handler: Any) -> bool:
        if index < after:
            return False
        head = f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain\r\nContent-Length: {size}\r\n\r\n"
        if not write_raw(receiver, handler, head.encode()):
            return True
        chunk = b"x" * 65536
        while receiver.sent_bytes < size and not receiver.stopping.is_set():
            piece = chunk[: size - receiver.sent_bytes]
            if not write_raw(receiver, handler, piece):
                break
            receiver.sent_bytes += len(piece)
        return True

    return script


def too_large_over(limit: int) -> Script:
    """Requests whose body passes ``limit`` bytes answered 413 (a collector's request size limit)."""
    return too_large_when(lambda body: len(body) > limit)


def too_many_spans_over(most: int) -> Script:
    """Requests carrying more than ``most`` spans answered 413 (a limit a batch of two can pass)."""
    return too_large_when(lambda body: span_count(body) > most)


def too_large_when(refused: Callable[[bytes], bool]) -> Script:
    """Requests whose body ``refused`` says is too large answered 413 Request Entity Too Large."""

    def script(receiver: OtlpReceiver, index: int, request: Received, handler: Any) -> bool:
        if not refused(request.body):
            return False
        write_raw(
            receiver,
            handler,
            b"HTTP/1.1 413 Request Entity Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        )
        return True

    return script


def span_count(body: bytes) -> int:
    """How many spans one request's body carries (an empty body, the probe's: none)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    decoded = ExportTraceServiceRequest.FromString(body)
    return sum(len(scope.spans) for resource in decoded.resource_spans for scope in resource.scope_spans)


def rejecting(rejected: int, message: str = "too old") -> Script:
    """Every export request (the probe's aside) answered 200 with OTLP's partial success:
    ``rejected`` spans rejected, ``message`` its error."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    answer = ExportTraceServiceResponse()
    answer.partial_success.rejected_spans = rejected
    answer.partial_success.error_message = message
    body = answer.SerializeToString()

    def script(receiver: OtlpReceiver, index: int, request: Received, handler: Any) -> bool:
        return index > 0 and answer_raw(receiver, handler, "200 OK", "application/x-protobuf", body)

    return script


def other_loopback_host() -> str:
    """Another loopback address than 127.0.0.1 when this machine routes one (Linux routes all of
    127/8), else 127.0.0.1: either way another origin than the receiver's."""
    try:
        with socket.socket() as sock:
            sock.bind(("127.0.0.2", 0))
        return "127.0.0.2"
    except OSError:
        return "127.0.0.1"
