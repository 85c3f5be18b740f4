"""Serve the shipped deployments from this machine with ``serve()``: no work pool, no worker.

    rollout-capture serve          # or: python -m rollout_capture.deployments.serve

The scheduled deployment enriches finished runs under ``$ROLLOUT_CAPTURE_RUNS_ROOT``
(default ``./runs``) every 15 minutes (``$ROLLOUT_CAPTURE_CRON``); the other two are run
on demand from the UI or ``prefect deployment run``.
"""

from __future__ import annotations

import os

from prefect import serve

from rollout_capture.deployments.shipped import DEFAULT_CRON, shipped_deployments


def main() -> None:
    """Serve until interrupted."""
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "rollout_capture")
    runs_root = os.environ.get("ROLLOUT_CAPTURE_RUNS_ROOT", os.path.abspath("runs"))
    cron = os.environ.get("ROLLOUT_CAPTURE_CRON", DEFAULT_CRON)
    serve(*shipped_deployments(runs_root, cron=cron))


if __name__ == "__main__":
    main()
