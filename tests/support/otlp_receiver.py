"""A tiny OTLP/HTTP receiver: an HTTP server thread on a loopback port that records each POST's
path, headers and body and answers 200 (the trace export's tests, without Phoenix)."""

from __future__ import annotations

import http.server
import threading
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Received:
    """One POST: its path, its headers (names lower-cased: HTTP's are case-blind), its body."""

    path: str
    headers: dict[str, str]
    body: bytes


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
    ) -> None:
        """Every request answered ``status``; with ``refuse``, a request carrying spans is answered
        that; with ``then``, the first request (the probe) gets 200 and the next ones ``then``'s;
        ``retry_after`` goes with every refusal as its ``Retry-After`` header."""
        self.received: list[Received] = []
        self.refuse, self.status, self.then = refuse, status, list(then or [])
        self.retry_after = retry_after
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {name.lower(): value for name, value in self.headers.items()}
                receiver.received.append(Received(self.path, headers, body))
                status = receiver.answer(body)
                self.send_response(status)
                if receiver.retry_after is not None and status >= 400:
                    self.send_header("Retry-After", receiver.retry_after)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

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
        """Every span received, decoded from the protobuf bodies (the probe's is empty)."""
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        out: list[Any] = []
        for request in self.received:
            decoded = ExportTraceServiceRequest.FromString(request.body)
            for resource in decoded.resource_spans:
                for scope in resource.scope_spans:
                    out.extend(scope.spans)
        return out

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
