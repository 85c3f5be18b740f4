"""A TCP proxy in front of the S3 endpoint that can go down: real outages for real clients.

While down it refuses connections (the listening socket is closed) and has cut every
open one, which is what an unreachable endpoint looks like to botocore and s3fs.
"""

from __future__ import annotations

import contextlib
import re
import socket
import struct
import threading
import time

_REQUEST_LINE = re.compile(rb"(?m)^(GET|HEAD|PUT|POST|DELETE) (\S+) HTTP/1\.[01]\r$")
_SLOW_DOWN_BODY = (
    b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
    b"<Message>Please reduce your request rate.</Message></Error>"
)
_SLOW_DOWN = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
    + f"Content-Length: {len(_SLOW_DOWN_BODY)}\r\n\r\n".encode()
    + _SLOW_DOWN_BODY
)
_ACCESS_DENIED_BODY = (
    b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>AccessDenied</Code>"
    b"<Message>Access Denied</Message></Error>"
)
_ACCESS_DENIED = (
    b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\nConnection: close\r\n"
    + f"Content-Length: {len(_ACCESS_DENIED_BODY)}\r\n\r\n".encode()
    + _ACCESS_DENIED_BODY
)


_STATUS_LINE = re.compile(rb"HTTP/1\.[01] ([2-5]\d\d) ")
_GCS_LISTING = re.compile(rb"^/storage/v1/b/[^/?]+/o(\?|$)")
_DELETES = re.compile(rb"^(DELETE \S+|POST \S+\?delete\S*) HTTP/1\.[01]\r\n")
_KEY = re.compile(rb"<Key>(.*?)</Key>")


def _refused_deletes(keys: list[bytes]) -> bytes:
    """S3's answer to a DeleteObjects whose every key the caller may not delete: 200, each key an
    ``AccessDenied`` error in the body (what AWS answers a user without ``s3:DeleteObject``)."""
    errors = b"".join(
        b"<Error><Key>" + key + b"</Key><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
        for key in keys
    )
    body = b"<?xml version='1.0' encoding='UTF-8'?><DeleteResult>" + errors + b"</DeleteResult>"
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/xml\r\nConnection: close\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


def interim_prefix(answer: bytes) -> tuple[int, bool | None]:
    """How many leading bytes of ``answer`` are complete interim (1xx) responses, and whether the
    final answer begins right after them (``None``: not told yet, more bytes are needed).

    A store may send several interim answers (moto sends two ``100 Continue``: http.server's, then
    werkzeug's, the second sometimes after the body) and the last can reach us in one piece with
    the final answer, so "the answer" is not "the next chunk that is not a 100"."""
    at = 0
    while True:
        if len(answer) - at < 12:  # "HTTP/1.1 NNN"
            return at, None
        code = answer[at + 9 : at + 12]
        if not code.startswith(b"1") or code == b"101":
            return at, True
        end = answer.find(b"\r\n\r\n", at)
        if end < 0:
            return at, None
        at = end + 4


def request_kind(method: bytes, target: bytes) -> str:
    """LIST, GET, HEAD, PUT, DELETE... of one request line to S3, GCS's JSON API or Azure Blob."""
    if method == b"GET" and (b"list-type=" in target or b"comp=list" in target or _GCS_LISTING.match(target)):
        return "LIST"
    if method == b"POST" and b"?delete" in target:
        return "DELETE"
    return method.decode()


class FaultProxy:
    """Forwards 127.0.0.1:<port> to ``target``; ``outage()`` makes it unreachable for a while.

    It also counts the requests crossing it by kind, and can answer the next requests
    with ``503 SlowDown`` (``throttle``), as a busy S3 prefix does.
    """

    def __init__(self, target_host: str, target_port: int, latency_s: float = 0.0) -> None:
        self.target = (target_host, target_port)
        self.latency_s = latency_s  # added before forwarding each request, as a network would
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._trigger: tuple[bytes, float] | None = None
        self._throttle = 0
        self._lose_pattern: bytes | None = None
        self._lose_times = 0
        # upstream sockets whose next final answer is dropped: the bytes of it held meanwhile
        self._lose: dict[socket.socket, bytes] = {}
        self._lose_every: tuple[bytes, int] | None = None
        self._lose_seen = 0
        self._deny: bytes | None = None
        self._refuse_deletes = False
        self._hold: bytes | None = None
        self._release = threading.Event()
        self._drop_held = False
        self.held = 0
        self.denied = 0
        self.lost = 0
        self.outages = 0
        self.throttled = 0
        self.requests: dict[str, int] = {}
        self.bytes_down = 0  # body bytes the store sent back (status lines and headers left out)
        self.statuses: dict[int, int] = {}  # final answers by status (a line found in a chunk)
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
                if not from_client and source in self._lose:
                    with self._lock:
                        data = self._lose.get(source, b"") + data
                    passed, final = interim_prefix(data)
                    if passed:
                        sink.sendall(data[:passed])  # a 100 Continue gets through, the answer does not
                    if final:
                        return  # the request was served; its answer never arrives (counted below)
                    with self._lock:
                        if source in self._lose:  # not counted by the other side's end meanwhile
                            self._lose[source] = data[passed:]
                    continue
                if not from_client:
                    self._count_answer(data)
                if from_client:
                    if self._trigger is not None and self._fire(data):
                        return  # this request dies with the endpoint
                    if self._hold is not None and self._hold in data:
                        with self._lock:
                            self._hold, release = None, self._release
                            self.held += 1
                        release.wait()
                        if self._drop_held:
                            return  # never forwarded: the store never sees it
                    if self._refuse_deletes and _DELETES.match(data):
                        self._refuse_delete(source, data)
                        return
                    if self._deny is not None and self._deny in data:
                        with self._lock:
                            self.denied += 1
                        source.sendall(_ACCESS_DENIED)  # never forwarded: the store is untouched
                        return
                    if self._lose_every is not None and self._lose_every[0] in data:
                        with self._lock:
                            self._lose_seen += 1
                            if self._lose_seen % self._lose_every[1] == 0:
                                self._lose[sink] = b""
                    if self._lose_pattern is not None and self._lose_pattern in data:
                        with self._lock:
                            self._lose_times -= 1
                            if self._lose_times <= 0:
                                self._lose_pattern = None
                            self._lose[sink] = b""
                    throttled, requests = self._count(data)
                    if throttled:
                        source.sendall(_SLOW_DOWN)
                        return
                    if requests and self.latency_s:
                        time.sleep(self.latency_s)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:  # counted before the client can see the connection end
                for sock in (source, sink):
                    if self._lose.pop(sock, None) is not None:
                        self.lost += 1  # dropped, or the connection ended first: never answered
            for sock in (source, sink):
                with contextlib.suppress(OSError):  # wakes the pump blocked on the other socket
                    sock.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    sock.close()
            with self._lock:
                self._sockets -= {source, sink}

    def _count(self, data: bytes) -> tuple[bool, int]:
        """Count the requests in ``data``: (whether to throttle the first, how many there are)."""
        kinds = [request_kind(m.group(1), m.group(2)) for m in _REQUEST_LINE.finditer(data)]
        with self._lock:
            if kinds and self._throttle > 0:
                self._throttle -= 1
                self.throttled += 1
                return True, len(kinds)
            for kind in kinds:
                self.requests[kind] = self.requests.get(kind, 0) + 1
        return False, len(kinds)

    def _count_answer(self, data: bytes) -> None:
        codes, head = [], 0
        for found in _STATUS_LINE.finditer(data) if b"HTTP/1." in data else ():
            codes.append(int(found.group(1)))
            end = data.find(b"\r\n\r\n", found.start())
            head += (end + 4 if end >= 0 else len(data)) - found.start()
        with self._lock:
            self.bytes_down += len(data) - head
            for code in codes:
                self.statuses[code] = self.statuses.get(code, 0) + 1

    def reset_answers(self) -> dict[str, object]:
        """The body bytes the store sent back and its answers by status so far, then start again."""
        with self._lock:
            statuses = dict(sorted(self.statuses.items()))
            out: dict[str, object] = {"bytes": self.bytes_down, "statuses": statuses}
            self.bytes_down, self.statuses = 0, {}
        return out

    def throttle(self, requests: int) -> None:
        """Answer the next ``requests`` requests with 503 SlowDown."""
        with self._lock:
            self._throttle = requests

    def reset_counts(self) -> dict[str, int]:
        """The counts so far, then start again from zero."""
        with self._lock:
            counts, self.requests = self.requests, {}
        return counts

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

    def lose_answer_on(self, pattern: bytes, times: int = 1) -> None:
        """Forward the next ``times`` requests carrying ``pattern``, each time cutting the
        connection before its final answer (interim ``100 Continue`` answers get through);
        :attr:`lost` counts the requests whose answer never reached the client (``times=0``: stop
        losing answers)."""
        with self._lock:
            self._lose_pattern, self._lose_times = (pattern if times > 0 else None), times

    def lose_every(self, pattern: bytes | None, k: int = 3) -> None:
        """Lose the answer of every ``k``-th request carrying ``pattern`` (None: stop)."""
        with self._lock:
            self._lose_every, self._lose_seen = (None if pattern is None else (pattern, k)), 0

    def hold_on(self, pattern: bytes) -> None:
        """Hold the next request carrying ``pattern`` unforwarded until :meth:`release_held`
        (a request slow on the wire, or one whose sender dies before it arrives)."""
        with self._lock:
            self._hold, self._release, self._drop_held = pattern, threading.Event(), False

    def release_held(self, *, drop: bool = False) -> None:
        """Forward the held request now (``drop``: cut it instead, so it never lands)."""
        self._drop_held = drop
        self._release.set()

    def _refuse_delete(self, source: socket.socket, data: bytes) -> None:
        """Read the delete request whole, then refuse it as S3 refuses a user without the right:
        a DeleteObject 403, a DeleteObjects 200 listing each key as an error. Never forwarded."""
        while b"\r\n\r\n" not in data:
            data += source.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = re.search(rb"(?im)^content-length: *(\d+)\r?$", head)
        if re.search(rb"(?im)^expect: *100-continue\r?$", head):
            source.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        while length is not None and len(body) < int(length.group(1)):
            body += source.recv(65536)
        with self._lock:
            self.denied += 1
        source.sendall(_refused_deletes(_KEY.findall(body)) if head.startswith(b"POST") else _ACCESS_DENIED)

    def refuse_deletes(self, refuse: bool = True) -> None:
        """Refuse every delete (DeleteObject, DeleteObjects) as a user without delete rights is."""
        self._refuse_deletes = refuse

    def deny_on(self, pattern: bytes | None) -> None:
        """Answer every request carrying ``pattern`` 403 AccessDenied, unforwarded (None: stop)."""
        self._deny = pattern

    def outage_on(self, pattern: bytes, seconds: float) -> None:
        """Go down for ``seconds`` the first time a request carrying ``pattern`` passes."""
        self._trigger = (pattern, seconds)

    def close(self) -> None:
        self.down()
