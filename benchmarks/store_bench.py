"""The object store of ``bench_proxy.py --store s3``: moto, and a counting, slowed proxy to it.

moto (``python -m moto.server``) is one Python process; the request-counting proxy in front
of it (tests/support/fault_proxy.py's FaultProxy, adding a fixed latency per request as a network
would) runs in a second one, so neither shares an interpreter, and its GIL, with the load
generator or the capture proxy being measured. The bench talks to the counting proxy over
its stdin/stdout: ``peek`` (counts so far), ``reset`` (counts so far, then zero), ``answers``
(bytes sent back and answers by status so far, then zero), ``rtt``
(a few HEADs' round trips through it, in ms, uncounted).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# moto accepts any keys; fixed dummy ones so a developer's real keys never reach it.
DUMMY_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(host: str, port: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
            return
        time.sleep(0.1)
    raise RuntimeError(f"moto server did not start on {host}:{port}")


class Moto:
    """moto's S3 server in its own process, on a free port; ``endpoint`` reaches it directly."""

    def __init__(self) -> None:
        self.host, self.port = "127.0.0.1", free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.moto_s3", "-H", self.host, "-p", str(self.port)],
            cwd=ROOT,  # its conditional writes atomic, as S3's (tests/support/moto_s3.py)
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **DUMMY_CREDENTIALS},
        )
        try:
            wait_for_port(self.host, self.port)
        except RuntimeError:
            self.close()
            raise

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def make_bucket(self, bucket: str) -> None:
        """Create ``bucket`` (moto takes an unsigned PUT)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            conn.request("PUT", f"/{bucket}", body=b"")
            response = conn.getresponse()
            response.read()
            if response.status not in (200, 409):
                raise RuntimeError(f"moto did not create bucket {bucket}: HTTP {response.status}")
        finally:
            conn.close()

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


class CountingProxy:
    """A FaultProxy in front of moto, in its own process: requests counted by method, ``latency_ms`` each."""

    def __init__(self, target_port: int, latency_ms: float) -> None:
        self.latency_ms = latency_ms
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--target-port", str(target_port), "--latency-ms", str(latency_ms)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        self.port = int(self._line())

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the counting proxy exited")
        return line

    def _ask(self, command: str) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def peek(self) -> dict[str, int]:
        """Requests by method since the last reset."""
        return dict(self._ask("peek"))

    def reset(self) -> dict[str, int]:
        """Requests by method since the last reset, then start again from zero."""
        return dict(self._ask("reset"))

    def answers(self) -> dict[str, Any]:
        """The body bytes the store sent back (``bytes``) and its answers by status (``statuses``)
        since the last call, then start again from zero."""
        return dict(self._ask("answers"))

    def round_trips_ms(self, bucket: str) -> list[float]:
        """A few HEADs' round trips through this proxy, one after another (what one store request
        costs on the wire, without botocore's CPU); these requests are not counted."""
        return [float(ms) for ms in self._ask(f"rtt {bucket}")]

    def wait_quiet(self, settle_s: float = 0.3, limit_s: float = 10.0) -> float:
        """Wait until no request crossed for ``settle_s`` (a layout's writes after the last byte:
        releases, a group commit's flush), at most ``limit_s``; the seconds waited."""
        started = time.perf_counter()
        last = sum(self.peek().values())
        quiet_since = time.perf_counter()
        while time.perf_counter() - started < limit_s:
            time.sleep(0.1)
            now = sum(self.peek().values())
            if now != last:
                last, quiet_since = now, time.perf_counter()
            elif time.perf_counter() - quiet_since >= settle_s:
                break
        return round(time.perf_counter() - started, 2)

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            self.proc.wait(10)


def read_back(
    url: str, storage_options: Mapping[str, Any], rollout_ids: Iterable[str], calls: int
) -> dict[str, Any]:
    """What the store holds for ``rollout_ids`` after their ``calls`` calls, read by the
    project's own reader: rows against calls, rows sharing a model_call_id, damage, claims left."""
    from rollout_capture import CaptureStore

    ids = list(rollout_ids)
    started = time.perf_counter()
    try:
        store = CaptureStore(url, storage_options=dict(storage_options))
        fetched = store.prefetch(ids)
        snapshots = [fetched.snapshot(rid) for rid in ids]
    except Exception as exc:  # a layout the reader cannot read is a result, not a crash
        return {"error": f"{type(exc).__name__}: {exc}"}
    call_ids: Counter[str] = Counter()
    rows = damaged = claims = 0
    for snap in snapshots:
        rows += len(snap.rows)
        damaged += len(snap.damaged)
        claims += len(snap.claims)
        call_ids.update(str(row.get("model_call_id")) for _, row in snap.rows)
    return {
        "calls": calls,
        "rows": rows,
        "missing": max(0, calls - len(call_ids)),
        "duplicated": rows - len(call_ids),
        "damaged": damaged,
        "claims_left": claims,
        "complete": len(call_ids) == calls and rows == calls and not damaged,
        "read_s": round(time.perf_counter() - started, 2),
    }


def journal_census(
    url: str, storage_options: Mapping[str, Any], counted: set[str], calls: int
) -> dict[str, Any]:
    """The journal commits under ``url`` not in ``counted`` (which then holds them too): by stream,
    commits, tombstones, entries each, the writers that made them, commits a call."""
    import fsspec
    import orjson

    fs, root = fsspec.core.url_to_fs(url, **storage_options, skip_instance_cache=True)
    found = [key for key in fs.find(f"{root}/_journal") if key.endswith(".jsonl") and key not in counted]
    counted.update(found)
    bodies = fs.cat(found) if found else {}
    out: dict[str, Any] = {}
    for key, body in bodies.items():
        stream = "claims" if "/_journal/claims/" in key else "rows"
        head = orjson.loads(body.split(b"\n", 1)[0])
        mine = out.setdefault(stream, {"commits": 0, "tombstones": 0, "entries": 0, "writers": set()})
        mine["commits"] += 1
        mine["tombstones"] += bool(head.get("tombstone"))
        mine["entries"] += len(head.get("entries", ()))
        mine["writers"].add(head.get("writer"))
    for mine in out.values():
        mine["writers"] = len(mine["writers"])
        mine["entries_a_commit"] = round(mine["entries"] / max(1, mine["commits"] - mine["tombstones"]), 2)
        mine["commits_a_call"] = round(mine["commits"] / calls, 3)
    return out


def _head_ms(port: int, bucket: str, times: int = 7) -> list[float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    spent = []
    try:
        for _ in range(times):
            started = time.perf_counter()
            conn.request("HEAD", f"/{bucket}/bench-round-trip-probe")
            conn.getresponse().read()
            spent.append(time.perf_counter() - started)
    finally:
        conn.close()
    return [round(ms * 1000, 2) for ms in spent]


def serve_counting_proxy(target_port: int, latency_ms: float) -> None:
    """Run a FaultProxy to moto; answer the bench's commands on stdin until it closes."""
    from tests.support.fault_proxy import FaultProxy

    proxy = FaultProxy("127.0.0.1", target_port, latency_s=latency_ms / 1000)
    print(proxy.port, flush=True)
    try:
        for line in sys.stdin:
            command, _, rest = line.strip().partition(" ")
            if command == "peek":
                with proxy._lock:  # read only: the counts are FaultProxy's own
                    answer: Any = dict(proxy.requests)
            elif command == "reset":
                answer = proxy.reset_counts()
            elif command == "answers":
                answer = proxy.reset_answers()
            elif command == "rtt":
                before = proxy.reset_counts()
                answer = _head_ms(proxy.port, rest)
                proxy.reset_counts()
                with proxy._lock:  # put back what was counted before the probe
                    for kind, n in before.items():
                        proxy.requests[kind] = proxy.requests.get(kind, 0) + n
            else:
                answer = {"error": f"unknown command {command!r}"}
            print(json.dumps(answer), flush=True)
    finally:
        proxy.close()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="A counting, slowed proxy to moto (bench_proxy --store s3).")
    parser.add_argument("--target-port", type=int, required=True)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    options = parser.parse_args()
    serve_counting_proxy(options.target_port, options.latency_ms)
