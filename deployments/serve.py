"""Serve the flows from this machine with ``serve()``: no work pool, no worker to run.

    python deployments/serve.py        # or: rollout-capture serve

The scheduled deployment enriches finished runs under ``$ROLLOUT_CAPTURE_RUNS_ROOT``
(default ``./runs``) every 15 minutes (``$ROLLOUT_CAPTURE_CRON``); the other two are run
on demand from the UI or ``prefect deployment run``.
"""

from __future__ import annotations

import os
from typing import cast

from prefect import serve
from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.deployments.runner import RunnerDeployment

from rollout_capture.flows import enrich_completed_runs, enrich_rollouts, prepare_dispatch


def main() -> None:
    """Serve until interrupted."""
    # Flow runs are child processes: they set their logging up with the core's logger forwarded.
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "rollout_capture")
    runs_root = os.environ.get("ROLLOUT_CAPTURE_RUNS_ROOT", os.path.abspath("runs"))
    cron = os.environ.get("ROLLOUT_CAPTURE_CRON", "*/15 * * * *")
    deployments = [
        enrich_completed_runs.to_deployment(
            name="scheduled",
            cron=cron,
            parameters={"runs_root": runs_root},
            tags=["rollout-capture"],
            # A tick still running when the next is due: the new one is cancelled, never queued.
            concurrency_limit=ConcurrencyLimitConfig(
                limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW
            ),
        ),
        enrich_rollouts.to_deployment(name="on-demand", tags=["rollout-capture"]),
        prepare_dispatch.to_deployment(name="on-demand", tags=["rollout-capture"]),
    ]
    serve(*(cast(RunnerDeployment, d) for d in deployments))  # sync context: never coroutines


if __name__ == "__main__":
    main()
