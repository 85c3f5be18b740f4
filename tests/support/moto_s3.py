"""moto's S3 server with conditional writes decided atomically, as S3 decides them.

moto checks a PUT's ``If-None-Match: *`` (or ``If-Match``) and then writes the object, in one of
its server's threads, with nothing held between the two: two writers racing for one key can both
pass the check and both be told they created it, the second overwriting the first. S3 decides a
conditional write atomically, and our writers rely on it (spec 2: a number is taken by one writer
only). Seen under ``make test-stress``: four writer processes racing for a rollout's row numbers
on moto read back 199 rows of 200, one row overwritten by another writer's "create". Here a lock
makes every conditional write one step; other requests run as before, in parallel.

``python -m tests.support.moto_s3 -H HOST -p PORT`` serves it in a process of its own (benchmarks).
"""

from __future__ import annotations

import argparse
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from moto.moto_server.threaded_moto_server import ThreadedMotoServer
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from werkzeug.serving import BaseWSGIServer, make_server

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
_CONDITIONS = ("HTTP_IF_NONE_MATCH", "HTTP_IF_MATCH")


class AtomicConditionalWrites:
    """WSGI middleware: a write carrying a condition runs whole (check, write, answer) under one lock."""

    def __init__(self, app: WsgiApp) -> None:
        self.app = app
        self._lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        conditional = environ.get("REQUEST_METHOD") in ("PUT", "POST") and any(
            key in environ for key in _CONDITIONS
        )
        if not conditional:
            return self.app(environ, start_response)
        with self._lock:
            return list(self.app(environ, start_response))  # the answer built before the next write


def moto_app() -> WsgiApp:
    """moto's WSGI application, its conditional writes atomic."""
    return AtomicConditionalWrites(DomainDispatcherApplication(create_backend_app))


def moto_server(host: str, port: int) -> BaseWSGIServer:
    """A threaded HTTP server of :func:`moto_app` on ``host:port`` (0: a free port), not serving yet."""
    return make_server(host, port, moto_app(), True, request_handler=MotoRequestHandler)


class AtomicMotoServer(ThreadedMotoServer):
    """moto's threaded server (a thread of this process) serving :func:`moto_app`."""

    def _server_entry(self) -> None:
        self._server = moto_server(self._ip_address, self._port)
        self._server_ready_event.set()
        self._server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, default=5000)
    args = parser.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    moto_server(args.host, args.port).serve_forever()


if __name__ == "__main__":
    main()
