"""``rollout-capture`` run as a user runs it: a fresh ``python -m rollout_capture.cli`` process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
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


def running_until(process: subprocess.Popen[str], check: Callable[[], object], what: str) -> None:
    """Wait until ``check()`` is truthy, for as long as ``process`` (a serve, a worker) runs: on a
    loaded machine one may take minutes to start, so no window decides; one that exits first fails
    at once with what it said (pytest-timeout bounds a hang)."""
    while not check():
        still_running(process, what)
        time.sleep(0.2)


def still_running(process: subprocess.Popen[str], what: str) -> bool:
    """True while ``process`` runs; once it has exited, an ``AssertionError`` with what it said."""
    if process.poll() is None:
        return True
    said = process.communicate()[0] if process.stdout is not None else ""
    raise AssertionError(f"{what}: it exited first, with {process.returncode}: {said[-4000:]}")


def interrupted(process: subprocess.Popen[str]) -> str:
    """Ctrl-C (SIGINT) to a serve or a worker, then all it wrote once it has exited: its shutdown
    is waited for however long a loaded machine makes it (pytest-timeout bounds a hang; a process
    still there when the wait is cut short is killed, never left behind)."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
    try:
        return process.communicate()[0] if process.stdout is not None else ""
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


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
