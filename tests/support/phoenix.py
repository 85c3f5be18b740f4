"""``phoenix serve`` on free ports with its own working dir, telemetry off: one shared starter for
the tests that read traces back from a real Phoenix, and its REST API's span listing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..conftest import wait_for


@dataclass
class Phoenix:
    url: str
    otlp: str


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def phoenix_server(work: Path) -> Iterator[Phoenix]:
    """A Phoenix server working in ``work`` until the block ends (its log in ``work/phoenix.log``)."""
    port, grpc_port = _free_port(), _free_port()
    env = {
        **os.environ,
        "PHOENIX_WORKING_DIR": str(work),
        "PHOENIX_PORT": str(port),
        "PHOENIX_GRPC_PORT": str(grpc_port),
        "PHOENIX_HOST": "127.0.0.1",
        "PHOENIX_TELEMETRY_ENABLED": "false",
    }
    log = (work / "phoenix.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "phoenix.server.main", "serve"], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert process.poll() is None, f"phoenix exited: {(work / 'phoenix.log').read_text()[-2000:]}"
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=2) as answer:
                return bool(answer.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    try:
        # As long as it lives (healthy() fails at once if it exits): its start takes minutes on a
        # loaded machine, and pytest-timeout bounds a hang.
        wait_for(healthy, timeout_s=3600, what="phoenix serve's /healthz", poll_s=0.5)
        yield Phoenix(url, f"{url}/v1/traces")
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        log.close()


def phoenix_spans(phoenix: Phoenix, project: str) -> list[dict[str, Any]]:
    """Every span of the project, through Phoenix's REST API (``/v1/projects/{project}/spans``)."""
    spans: list[dict[str, Any]] = []
    cursor = None
    while True:
        query = "limit=1000" + (f"&cursor={cursor}" if cursor else "")
        try:
            with urllib.request.urlopen(
                f"{phoenix.url}/v1/projects/{project}/spans?{query}", timeout=30
            ) as r:
                page = json.load(r)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:  # no such project yet: nothing arrived
                return []
            raise
        spans.extend(page["data"])
        cursor = page.get("next_cursor")
        if not cursor:
            return spans


def settled_spans(phoenix: Phoenix, count: int, project: str) -> list[dict[str, Any]]:
    """The project's spans once ``count`` have been ingested (Phoenix inserts asynchronously)."""
    found: list[dict[str, Any]] = []

    def enough() -> bool:
        found[:] = phoenix_spans(phoenix, project)
        return len(found) >= count

    wait_for(enough, timeout_s=60, what=f"{count} spans in Phoenix", poll_s=0.25)
    return found
