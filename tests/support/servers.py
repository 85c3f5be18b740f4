"""ASGI apps served by uvicorn on a loopback port, in a thread of the test process."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import uvicorn


class ThreadedServer:
    """One uvicorn server in a daemon thread; ``url`` is ``http://127.0.0.1:<free port>``."""

    def __init__(self, app: Any, *, graceful_s: int = 1) -> None:
        # IPPROTO_TCP: asyncio disables Nagle only on sockets that say they are TCP.
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(512)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, lifespan="on", log_level="warning", access_log=False, timeout_graceful_shutdown=graceful_s
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.005)

    def _run(self) -> None:
        asyncio.run(self.server.serve(sockets=[self.sock]))

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()
