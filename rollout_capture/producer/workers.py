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
    args: Callable[[int], tuple[Any, ...]],
    count: int,
    *,
    stop_timeout_s: float,
    on_stop: Callable[[], None] | None = None,
    started: Callable[[int], None] | None = None,
    name: str = "worker",
) -> None:
    """Run ``count`` spawned processes, worker ``i`` running ``target(*args(i))``, until SIGINT
    or SIGTERM. ``on_stop`` is called once the stop begins (the parent lets go of its sockets);
    ``started(i)`` each time worker ``i`` was spawned (what ``args(i)`` handed it is its own now).

    The first signal sends SIGTERM to every worker (they stop accepting and finish what is in
    flight); a later SIGINT is passed on as SIGINT (a server's "stop now"), as a second Ctrl-C
    is to a single process. A worker still alive ``stop_timeout_s`` after the stop began is
    killed. A worker that dies while serving is reported and started again; one that exits
    with ``STARTUP_FAILURE`` stops them all and raises ``WorkerStartupFailed``. Main thread only
    (it handles the signals).
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("several workers are supervised from the main thread (it takes the signals)")
    _Supervisor(target, args, name, stop_timeout_s, on_stop, started).run(count)


class _Supervisor:
    """The parent's state: its workers, the restarts due, and whether (since when) it is stopping."""

    def __init__(
        self,
        target: Callable[..., None],
        args: Callable[[int], tuple[Any, ...]],
        name: str,
        stop_timeout_s: float,
        on_stop: Callable[[], None] | None,
        started: Callable[[int], None] | None = None,
    ) -> None:
        self.target, self.args, self.name = target, args, name
        self.stop_timeout_s = stop_timeout_s
        self.on_stop = on_stop
        self.started = started
        self.context = multiprocessing.get_context("spawn")
        self.workers: dict[int, _Worker] = {}
        self.restarts: dict[int, float] = {}  # index -> when to start it again
        self.stopping_since: float | None = None
        self.killed = False
        self.failed: str | None = None
        self.signals: list[int] = []

    def run(self, count: int) -> None:
        wake_r, wake_w = socket.socketpair()  # a signal wakes the wait below (set_wakeup_fd)
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        previous_wakeup = signal.set_wakeup_fd(wake_w.fileno())
        try:
            for index in range(count):
                self._start(index)
            while self.workers or self.restarts:
                wait([w.process.sentinel for w in self.workers.values()] + [wake_r], self._timeout())
                with contextlib.suppress(BlockingIOError):
                    while wake_r.recv(64):
                        pass
                self._take_signals()
                self._reap()
                self._restart_due()
                self._kill_overdue()
        finally:
            for worker in self.workers.values():  # an error of our own: leave nothing running
                worker.process.kill()
                worker.process.join()
            signal.set_wakeup_fd(previous_wakeup)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            wake_r.close()
            wake_w.close()
        if self.failed is not None:
            raise WorkerStartupFailed(self.failed)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals.append(signum)

    def _start(self, index: int) -> None:
        process = self.context.Process(target=self.target, args=self.args(index), name=f"{self.name}-{index}")
        process.start()
        self.workers[index] = _Worker(index, process)
        if self.started is not None:
            self.started(index)

    def _stop(self) -> None:
        self.stopping_since = time.monotonic()
        self.restarts.clear()
        self._signal_all(signal.SIGTERM)
        if self.on_stop is not None:
            self.on_stop()

    def _timeout(self) -> float | None:
        """Seconds until the next restart is due or the stop runs out of time; None: no deadline."""
        if self.stopping_since is not None:
            deadlines = [] if self.killed else [self.stopping_since + self.stop_timeout_s]
        else:
            deadlines = list(self.restarts.values())
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _take_signals(self) -> None:
        while self.signals:
            signum = self.signals.pop(0)
            if self.stopping_since is None:
                how = signal.strsignal(signum)
                logger.info("stopping %d %s processes (%s)", len(self.workers), self.name, how)
                self._stop()
            elif signum == signal.SIGINT:
                self._signal_all(signal.SIGINT)

    def _reap(self) -> None:
        """Forget the workers that exited; while serving, report each and schedule its restart."""
        for index, worker in list(self.workers.items()):
            process = worker.process
            if process.is_alive():
                continue
            process.join()
            del self.workers[index]
            if self.stopping_since is not None:
                continue
            if process.exitcode == STARTUP_FAILURE:
                self.failed = f"{self.name} {index} (pid {process.pid}) could not start"
                logger.error("%s; stopping the others", self.failed)
                self._stop()
                continue
            lived = time.monotonic() - worker.started
            delay = RESTART_DELAY_S if lived < RESTART_DELAY_S else 0.0  # no tight crash loop
            logger.warning(
                "%s %d (pid %s) died (%s) after %.1f s; starting another%s",
                self.name,
                index,
                process.pid,
                _exit_reason(process.exitcode),
                lived,
                f" in {delay:.0f} s" if delay else "",
            )
            self.restarts[index] = time.monotonic() + delay

    def _restart_due(self) -> None:
        now = time.monotonic()
        for index, due in list(self.restarts.items()):
            if due <= now:
                del self.restarts[index]
                self._start(index)

    def _kill_overdue(self) -> None:
        if self.stopping_since is None or self.killed:
            return
        if time.monotonic() < self.stopping_since + self.stop_timeout_s:
            return
        for worker in self.workers.values():
            logger.error(
                "%s %d (pid %s) still running %.0f s after the stop: killed",
                self.name,
                worker.index,
                worker.process.pid,
                self.stop_timeout_s,
            )
            worker.process.kill()
        self.killed = True

    def _signal_all(self, signum: int) -> None:
        for worker in self.workers.values():
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
