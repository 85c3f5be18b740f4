"""Where the journal's writer and reader get time, waits and threads: the real ones here, a
seeded simulation's in the tests (``tests/support/journal_sim.py``), so every interleaving of
the real protocol code can be driven and replayed from a seed."""

from __future__ import annotations

import threading
import time as _time
from collections.abc import Callable
from types import TracebackType
from typing import Protocol


class Waitable(Protocol):
    """What the writer needs of a condition variable (``threading.Condition``'s shape)."""

    def __enter__(self) -> bool: ...
    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None, /
    ) -> None: ...
    def wait(self, timeout: float | None = None) -> bool: ...
    def notify_all(self) -> None: ...


class Clock(Protocol):
    """Time, sleeping, condition variables and threads, as the journal uses them."""

    def monotonic(self) -> float: ...
    def time(self) -> float: ...
    def sleep(self, seconds: float) -> None: ...
    def condition(self) -> Waitable: ...
    def start_thread(self, target: Callable[[], None], name: str) -> None: ...


class RealClock:
    """The process's own clock and threads."""

    monotonic = staticmethod(_time.monotonic)
    time = staticmethod(_time.time)
    sleep = staticmethod(_time.sleep)

    def condition(self) -> Waitable:
        return threading.Condition()

    def start_thread(self, target: Callable[[], None], name: str) -> None:
        threading.Thread(target=target, name=name, daemon=True).start()


REAL_CLOCK: Clock = RealClock()
