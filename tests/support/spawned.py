"""Entry points of the processes the tests spawn (writers racing on a capture, racers for a lease)."""

from __future__ import annotations

from multiprocessing.synchronize import Event
from typing import Any

from rollout_capture import CaptureStore


def write_rows(url: str, options: dict[str, Any], layout: str, writer: int, count: int, go: Event) -> None:
    """Write ``count`` rows as fast as possible once every writer is ready."""
    store = CaptureStore(url, storage_options=options, layout=layout)  # type: ignore[arg-type]
    go.wait(30)
    for n in range(count):
        # Lines far above PIPE_BUF: interleaved bytes would show as broken JSON.
        store.record("c-0", {"writer": writer, "n": n, "pad": f"{writer}" * (5000 + 3000 * (n % 7))})


def take_lease(
    root: str,
    run_name: str,
    go: Event,
    results: Any,
    options: dict[str, Any] | None = None,
    now: float | None = None,
) -> None:
    """Race for a run's lease; report whether this process got it. ``now``: the moment the
    race happens at, by this process's lease clock (default: the real time)."""
    from rollout_capture.run_folders import RunFolder, RunsRoot

    runs = RunsRoot(root, options, clock=None if now is None else (lambda: now))
    run = RunFolder(name=run_name, url=f"{root}/{run_name}", finished=True, enriched=False)
    go.wait(30)
    results.put(runs.acquire(run) is not None)


def run_tick(api_url: str, root: str, options: dict[str, Any] | None, lease_s: float) -> None:
    """One scheduled tick in a process of its own, reporting to the tests' Prefect API."""
    import os

    os.environ["PREFECT_API_URL"] = api_url  # before Prefect is imported here
    from rollout_capture.flows import enrich_completed_runs

    enrich_completed_runs(root, lease_s=lease_s, quiescence_timeout_s=600.0, storage_options=options)


def supervised(index: int, marks: str) -> None:
    """A supervised worker: worker 0 dies at once, then fails to start; the others wait to be stopped."""
    import os
    import sys
    import time
    from pathlib import Path

    from rollout_capture.producer.workers import STARTUP_FAILURE

    if index == 0:
        mark = Path(marks) / "died-once"
        if not mark.exists():
            mark.touch()
            os._exit(1)
        sys.exit(STARTUP_FAILURE)
    time.sleep(60)  # until the supervisor's SIGTERM


def run_tick_reporting(api_url: str, root: str, lease_s: float, report: str) -> None:
    """``run_tick``, then its summary written as JSON to ``report`` (the test reads what it enriched)."""
    import os

    os.environ["PREFECT_API_URL"] = api_url  # before Prefect is imported here
    from pathlib import Path

    from rollout_capture.flows import enrich_completed_runs

    summary = enrich_completed_runs(root, lease_s=lease_s, quiescence_timeout_s=600.0, max_parallel_runs=2)
    Path(report).write_text(summary.model_dump_json())


def run_tick_measured(api_url: str, root: str, report: str) -> None:
    """``run_tick`` on a local runs root (threads: one process), then its summary and this
    process's peak RSS (``VmHWM``, KiB: ``ru_maxrss`` would count the forking parent's) written as
    JSON to ``report``."""
    import json
    import os

    os.environ["PREFECT_API_URL"] = api_url  # before Prefect is imported here
    from pathlib import Path

    from rollout_capture.flows import enrich_completed_runs

    summary = enrich_completed_runs(root, quiescence_timeout_s=600.0)
    status = Path("/proc/self/status").read_text().splitlines()
    peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    Path(report).write_text(json.dumps({"summary": summary.model_dump(mode="json"), "peak_kib": peak}))


KILL_POINTS = ("mid-append", "after-append", "before-marker", "after-marker")
"""Where a killed follower dies: halfway through writing a round to its live output, right after a
round, after publishing its output but before ``_ENRICHED``, after ``_ENRICHED`` but before its
lease is dropped."""


def follow_until_killed(api_url: str, run: str, point: str, nth: int, options: dict[str, Any]) -> None:
    """``follow_run`` in a process of its own that SIGKILLs itself at ``point`` (its ``nth`` round
    for the live ones), as a crash there would leave things."""
    import os
    import signal

    os.environ["PREFECT_API_URL"] = api_url  # before Prefect is imported here
    from rollout_capture.flows.follow import follow_run
    from rollout_capture.live_output import LiveFile
    from rollout_capture.run_folders import RunsRoot

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    rounds = [0]
    append = LiveFile.append

    def dying_append(self: LiveFile, first_line: int, lines: Any) -> None:
        rounds[0] += 1
        if point == "mid-append" and rounds[0] == nth:
            data = b"".join(line + b"\n" for line in lines)
            assert self._fd is not None
            os.lseek(self._fd, 0, os.SEEK_END)
            os.write(self._fd, data[: len(data) // 2])
            die()
        append(self, first_line, lines)
        if point == "after-append" and rounds[0] == nth:
            die()

    LiveFile.append = dying_append  # type: ignore[method-assign]
    mark, drop = RunsRoot.mark_enriched, RunsRoot.drop_leases
    if point == "before-marker":
        RunsRoot.mark_enriched = lambda *args, **kwargs: die()  # type: ignore[method-assign]
    if point == "after-marker":
        RunsRoot.drop_leases = lambda *args, **kwargs: die()  # type: ignore[method-assign]
    follow_run(run, **options)
    RunsRoot.mark_enriched, RunsRoot.drop_leases = mark, drop  # type: ignore[method-assign]
    raise SystemExit(f"{point} #{nth} was never reached")


def follow_reporting(api_url: str, run: str, go: Event, report: str, options: dict[str, Any]) -> None:
    """``follow_run`` once every racer is ready; its summary written as JSON to ``report``."""
    import os

    os.environ["PREFECT_API_URL"] = api_url  # before Prefect is imported here
    from pathlib import Path

    from rollout_capture.flows.follow import follow_run

    go.wait(120)
    summary = follow_run(run, **options)
    Path(report).write_text(summary.model_dump_json())
