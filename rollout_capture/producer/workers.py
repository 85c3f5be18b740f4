"""Several server processes on one listening socket, and the parent that supervises them.

One event loop saturates one core, so a server that must use more runs several processes.
They are spawned, never forked (filesystems and event loops are not fork-safe); the parent
binds the socket once and hands it to each, so port 0 works and every process accepts on
the same port. The parent only watches: it restarts a process that dies (and says so),
gives up when one could not start, passes SIGINT/SIGTERM on as a single-process server
would take them, and returns once every process has stopped.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

logger = logging.getLogger("rollout_capture.producer")

# A worker exits with this when it could not start: it would fail the same way again (uvicorn's code).
STARTUP_FAILURE = 3
# A worker that dies sooner than this after its start is started again only after this long.
RESTART_DELAY_S = 1.0


class WorkerStartupFailed(RuntimeError):
    """A worker could not start (bad settings, an app that fails to build): the others were stopped."""


@dataclass
class _Worker:
    index: int
    process: BaseProcess
    started: float = field(default_factory=time.monotonic)


def follow_parent() -> None:
    """In a spawned worker: SIGTERM ourselves (a graceful stop) when the parent process is gone.

    A parent killed outright cannot stop its workers; without this they would go on serving
    an orphaned socket. The spawn machinery's pipe from the parent reads EOF when it dies.
    """
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="rollout-capture-parent-watch", daemon=True).start()


def supervise(
    target: Callable[..., None],
    args: tuple[Any, ...],
    count: int,
    *,
    stop_timeout_s: float,
    name: str = "worker",
) -> None:
    """Run ``count`` spawned processes of ``target(*args)`` until SIGINT or SIGTERM.

    The first signal sends SIGTERM to every worker (they stop accepting and finish what is in
    flight); a later SIGINT is passed on as SIGINT (a server's "stop now"), as a second Ctrl-C
    is to a single process. A worker still alive ``stop_timeout_s`` after the stop began is
    killed. A worker that dies while serving is reported and started again; one that exits
    with ``STARTUP_FAILURE`` stops them all and raises ``WorkerStartupFailed``. Main thread only
    (it handles the signals).
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("several workers are supervised from the main thread (it takes the signals)")
    context = multiprocessing.get_context("spawn")
    signals: list[int] = []
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        signals.append(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    previous_wakeup = signal.set_wakeup_fd(wake_w.fileno())

    def start(index: int) -> _Worker:
        process = context.Process(target=target, args=args, name=f"{name}-{index}")
        process.start()
        return _Worker(index, process)

    workers: dict[int, _Worker] = {}
    pending: dict[int, float] = {}  # index -> when to start it again
    stopping_since: float | None = None
    failed: str | None = None
    try:
        for index in range(count):
            workers[index] = start(index)
        while workers or pending:
            now = time.monotonic()
            if stopping_since is None:
                for index, due in list(pending.items()):
                    if due <= now:
                        del pending[index]
                        workers[index] = start(index)
            deadlines = list(pending.values())
            if stopping_since is not None and stop_timeout_s != float("inf"):
                deadlines = [stopping_since + stop_timeout_s]
            timeout = max(0.0, min(deadlines) - now) if deadlines else None
            wait([w.process.sentinel for w in workers.values()] + [wake_r], timeout)
            with contextlib.suppress(BlockingIOError):
                while wake_r.recv(64):
                    pass
            while signals:
                signum = signals.pop(0)
                if stopping_since is None:
                    stopping_since = time.monotonic()
                    pending.clear()
                    logger.info("stopping %d %s processes (%s)", len(workers), name, signal.strsignal(signum))
                    _signal_all(workers, signal.SIGTERM)
                elif signum == signal.SIGINT:
                    _signal_all(workers, signal.SIGINT)
            for index, worker in list(workers.items()):
                process = worker.process
                if process.is_alive():
                    continue
                process.join()
                del workers[index]
                if stopping_since is not None:
                    continue
                code = process.exitcode
                if code == STARTUP_FAILURE:
                    failed = f"{name} {index} (pid {process.pid}) could not start"
                    logger.error("%s; stopping the others", failed)
                    stopping_since = time.monotonic()
                    pending.clear()
                    _signal_all(workers, signal.SIGTERM)
                    continue
                lived = time.monotonic() - worker.started
                delay = RESTART_DELAY_S if lived < RESTART_DELAY_S else 0.0
                logger.warning(
                    "%s %d (pid %s) died (%s) after %.1f s; starting another%s",
                    name,
                    index,
                    process.pid,
                    _exit_reason(code),
                    lived,
                    f" in {delay:.0f} s" if delay else "",
                )
                pending[index] = time.monotonic() + delay
            if stopping_since is not None and time.monotonic() >= stopping_since + stop_timeout_s:
                for worker in workers.values():
                    logger.error(
                        "%s %d (pid %s) still running %.0f s after the stop: killed",
                        name,
                        worker.index,
                        worker.process.pid,
                        stop_timeout_s,
                    )
                    worker.process.kill()
                stop_timeout_s = float("inf")  # killed: now only wait for them to be gone
    finally:
        for worker in workers.values():  # an error of our own: leave nothing running
            worker.process.kill()
            worker.process.join()
        signal.set_wakeup_fd(previous_wakeup)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        wake_r.close()
        wake_w.close()
    if failed is not None:
        raise WorkerStartupFailed(failed)


def _signal_all(workers: dict[int, _Worker], signum: int) -> None:
    for worker in workers.values():
        pid = worker.process.pid
        if pid is not None and worker.process.exitcode is None:
            with contextlib.suppress(ProcessLookupError):  # gone between the check and the kill
                os.kill(pid, signum)


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "unknown exit"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:  # pragma: no cover
            return f"signal {-code}"
    return f"exit code {code}"
