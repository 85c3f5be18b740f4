"""The deployments rollout-capture ships, defined once for ``serve`` and ``rollout-capture deploy``.

Entrypoints are module paths (``rollout_capture.flows.enrich_runs.enrich_completed_runs``),
so a worker or a served process runs the installed package from any folder; no checkout,
no code storage.
"""

from __future__ import annotations

from typing import Any

from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.deployments.runner import RunnerDeployment
from prefect.events import DeploymentEventTrigger
from prefect.types.entrypoint import EntrypointType

from rollout_capture.deployments.names import ON_DEMAND, SCHEDULED, SERVED_SUFFIX, follow_name
from rollout_capture.flows.dispatch import prepare_dispatch
from rollout_capture.flows.enrich import enrich_rollouts
from rollout_capture.flows.enrich_runs import enrich_completed_runs
from rollout_capture.flows.follow import follow_run
from rollout_capture.run_events import RUN_FINISHED, RUN_PREFIX, RUN_STARTED, runs_under

DEFAULT_CRON = "*/15 * * * *"
TAGS = ["rollout-capture"]
# Flow runs are child processes of a worker or of serve: the core's logger reaches the UI.
JOB_VARIABLES = {"env": {"PREFECT_LOGGING_EXTRA_LOGGERS": "rollout_capture"}}


def shipped_deployments(
    runs_root: str,
    *,
    cron: str = DEFAULT_CRON,
    scheduled_parameters: dict[str, Any] | None = None,
    name: str = SCHEDULED,
    served: bool = False,
) -> list[RunnerDeployment]:
    """The scheduled enrichment of ``runs_root`` (deployment ``name``), its follower of started runs
    (``follow-runs``, or ``<name>-follow-runs``), plus the two on-demand flows.

    ``scheduled_parameters`` are the scheduled flow's other parameters (capture dir,
    runner, credentials block name: never a secret, the parameter schema refuses them).
    ``served``: every name gets :data:`SERVED_SUFFIX`, and no job variables (``serve`` sets
    the environment in its own process; Prefect refuses job variables without a work pool);
    a ``name`` other than the default also prefixes the on-demand ones (``<name>-enrich-rollouts-served``),
    since a served deployment belongs to its process: two serves of two roots share none.

    Example:
        ```python
        shipped_deployments("s3://my-runs/runs", name="enrich-s3-runs",
                            scheduled_parameters={"credentials_block": "rollout-capture"})
        ```
    """
    suffix = SERVED_SUFFIX if served else ""
    common: dict[str, Any] = {
        "tags": TAGS,
        "job_variables": None if served else JOB_VARIABLES,
        "entrypoint_type": EntrypointType.MODULE_PATH,
        "paused": False,  # registering again resumes a paused one (said in what it replaces)
    }
    scheduled = enrich_completed_runs.to_deployment(
        name=name + suffix,
        description=f"Every schedule tick ({cron}), enrich each finished run under {runs_root}.",
        cron=cron,
        parameters={"runs_root": runs_root, **(scheduled_parameters or {})},
        # A tick still running when the next is due: the new one is cancelled, never queued.
        concurrency_limit=ConcurrencyLimitConfig(
            limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW
        ),
        # A run finished under this root (``rollout-capture finish``): enriched now; the tick stays
        # the backstop, and the leases decide who enriches a run both reach.
        triggers=[
            DeploymentEventTrigger(
                name=f"{name + suffix}: a run finished",
                expect={RUN_FINISHED},
                match={"prefect.resource.id": runs_under(runs_root)},
            )
        ],
        **common,
    )
    follower = follow_run.to_deployment(
        name=follow_name(name) + suffix,
        description=f"Follow each run started under {runs_root} while it runs, then publish it.",
        parameters=_follow_parameters(scheduled_parameters or {}),
        # A run started under this root (``rollout-capture start``): followed now, a flow run a run.
        triggers=[
            DeploymentEventTrigger(
                name=f"{follow_name(name) + suffix}: a run started",
                expect={RUN_STARTED},
                match={"prefect.resource.id": runs_under(runs_root)},
                parameters={"run": STARTED_RUN},
            )
        ],
        **common,
    )
    rollouts_name, dispatch_name = ON_DEMAND
    if served and name != SCHEDULED:  # a second serve's own, not the first one's
        rollouts_name, dispatch_name = f"{name}-{rollouts_name}", f"{name}-{dispatch_name}"
    on_demand = [
        enrich_rollouts.to_deployment(
            name=rollouts_name + suffix, description="Enrich one rollouts file on demand.", **common
        ),
        prepare_dispatch.to_deployment(
            name=dispatch_name + suffix,
            description="Clear stale captures of the rollouts about to be dispatched.",
            **common,
        ),
    ]
    return [d for d in (scheduled, follower, *on_demand) if isinstance(d, RunnerDeployment)]


STARTED_RUN = f"{{{{ event.resource.id[{len(RUN_PREFIX)}:] }}}}"
"""The run a ``rollout-capture.run.started`` event names (its resource id past the prefix), as the
follower's trigger hands it to the flow run it starts."""


def _follow_parameters(scheduled: dict[str, Any]) -> dict[str, Any]:
    """The scheduled deployment's parameters that the follower takes too (capture dir, credentials
    block, storage options, runner, thresholds, traces): one root, read and judged one way."""
    accepted = set(follow_run.parameters.properties) - {"run"}
    return {key: value for key, value in scheduled.items() if key in accepted}
