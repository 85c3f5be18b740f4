"""``rollout-capture`` run as a user runs it: a fresh ``python -m rollout_capture.cli`` process."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

CLI = [sys.executable, "-m", "rollout_capture.cli"]
"""The command line, as a process's argv prefix (Popen, a pty)."""


def cli_env(api: str | None = None, base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """An environment for the command: ``base`` (default this one) without Prefect's analytics, an
    API when given, and ``extra``."""
    env = {**(os.environ if base is None else base), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    if api:
        env["PREFECT_API_URL"] = api
    return {**env, **extra}


def run_at_terminal(*args: str, env: Mapping[str, str], timeout: float = 120) -> tuple[int, str]:
    """Run the command with a pseudo-terminal as its stdin, stdout and stderr (what a person at a
    terminal sees: progress bars); ``(exit code, everything it wrote)`` once it ends."""
    import pty

    primary, secondary = pty.openpty()
    process = subprocess.Popen(
        [*CLI, *args], stdin=secondary, stdout=secondary, stderr=secondary, env=dict(env)
    )
    os.close(secondary)
    seen = b""
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # the other side closed: the process is done
            break
        if not chunk:
            break
        seen += chunk
    os.close(primary)
    return process.wait(timeout), seen.decode(errors="replace")


def run_cli(
    *args: str,
    api: str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """Run the command to its end, its output captured as text; ``env`` as given, else :func:`cli_env`."""
    environment = dict(env) if env is not None else cli_env()
    if api:
        environment["PREFECT_API_URL"] = api
    return subprocess.run(
        [*CLI, *args], env=environment, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


ROW = {
    "model_call_id": "c",
    "dialect": "chat",
    "status_code": 200,
    "latency_ms": 12.5,
    "response": {"model": "m"},
}
"""One captured call, as the CLI tests record it."""

URL_SECRET = "hunter2SECRET"
CREDENTIALED = f"s3://AKIAEXAMPLE:{URL_SECRET}@bucket/x"
"""A URL with credentials in it: every command refuses it and never echoes the secret."""


def refused_unechoed(code: int, output: str) -> None:
    """Exit 2, the URL's credentials on neither stream, and no Prefect server started first."""
    assert code == 2, output
    assert URL_SECRET not in output and "AKIAEXAMPLE" not in output, output
    assert "starting a temporary Prefect server" not in output  # refused before any server


def start_worker(pool: str, api: str, folder: Path) -> subprocess.Popen[str]:
    """A Prefect process worker of ``pool`` on ``api``, started in ``folder`` with a Prefect home of
    its own there, its output captured as text (stop it with SIGINT, as Ctrl-C does)."""
    return subprocess.Popen(
        [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool],
        cwd=folder,
        env=cli_env(api, PREFECT_HOME=str(folder / "worker-home")),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
