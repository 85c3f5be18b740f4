"""A TCP proxy in front of the S3 endpoint that can go down: real outages for real clients.

While down it refuses connections (the listening socket is closed) and has cut every
open one, which is what an unreachable endpoint looks like to botocore and s3fs.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time


class FaultProxy:
    """Forwards 127.0.0.1:<port> to ``target``; ``outage()`` makes it unreachable for a while."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._trigger: tuple[bytes, float] | None = None
        self.outages = 0
        self.port = self._listen(0)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _listen(self, port: int) -> int:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(128)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return int(listener.getsockname()[1])

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed: we are down
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:  # went down while this one was accepted
                    client.close()
                    upstream.close()
                    return
                self._sockets |= {client, upstream}
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, from_client: bool) -> None:
        try:
            while data := source.recv(65536):
                if from_client and self._trigger is not None and self._fire(data):
                    return  # this request dies with the endpoint
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.close()
            with self._lock:
                self._sockets -= {source, sink}

    def _fire(self, data: bytes) -> bool:
        """Start the planned outage if ``data`` carries its pattern (once, whoever sees it first)."""
        with self._lock:
            if self._trigger is None or self._trigger[0] not in data:
                return False
            seconds = self._trigger[1]
            self._trigger = None
        threading.Thread(target=self.outage, args=(seconds,), daemon=True).start()
        return True

    def down(self) -> None:
        """Refuse new connections and cut the open ones."""
        with self._lock:
            listener, self._listener = self._listener, None
            open_sockets, self._sockets = self._sockets, set()
        if listener is not None:
            # shutdown() first: close() alone leaves a listener that another thread is
            # blocked accept()ing on alive in the kernel, queueing connections nobody reads.
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for sock in open_sockets:
            with contextlib.suppress(OSError):  # reset, not a polite FIN: a dead endpoint
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()
        self.outages += 1

    def up(self) -> None:
        """Serve again, on the same port."""
        with self._lock:
            if self._listener is not None:
                return
        self._listen(self.port)

    def outage(self, seconds: float) -> None:
        """Be down for ``seconds`` (blocking)."""
        self.down()
        time.sleep(seconds)
        self.up()

    def outage_on(self, pattern: bytes, seconds: float) -> None:
        """Go down for ``seconds`` the first time a request carrying ``pattern`` passes."""
        self._trigger = (pattern, seconds)

    def close(self) -> None:
        self.down()
