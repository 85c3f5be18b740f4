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
