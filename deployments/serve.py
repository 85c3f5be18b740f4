"""``rollout-capture serve``: the shipped deployments served from this machine, no work pool or worker.

Served deployments have names of their own (``enrich-completed-runs-served``...): serving, and
stopping with Ctrl-C, never changes what ``rollout-capture deploy`` registered for the workers.
Stopping pauses what this serve registered and disables its triggers (the automations Prefect made
of them): a later ``finish`` under its root creates no run that nobody will pick up. A Ctrl-C (or
SIGTERM) while serve registers them waits for the registration to end, then stops all of it: one
cut short would stay registered, active, with nothing serving it (a loaded server takes seconds);
nor is the stop itself cut short by a second Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prefect.client.orchestration import get_client
from prefect.deployments.runner import RunnerDeployment
from prefect.exceptions import ObjectNotFound, TerminationSignal
from prefect.runner import Runner

from rollout_capture.deployments.names import SCHEDULED
from rollout_capture.deployments.register import ensure_automations
from rollout_capture.deployments.shipped import DEFAULT_CRON, JOB_VARIABLES, shipped_deployments


class NotServed(ValueError):
    """A deployment of a served name exists on a work pool: serving it would take it over."""


@dataclass
class Stopped:
    """What stopping a serve touched: its own deployments, paused, and their triggers, disabled;
    and any of its names it left alone (found on a work pool: not its own any more)."""

    paused: list[str] = field(default_factory=list)
    triggers_disabled: list[str] = field(default_factory=list)
    left_alone: dict[str, str] = field(default_factory=dict)
    served: bool = True
    """False when the stop came while serve registered its deployments: they were never served."""


def serve_shipped(
    runs_root: str,
    *,
    cron: str = DEFAULT_CRON,
    parameters: dict[str, Any] | None = None,
    name: str = SCHEDULED,
    serving: Callable[[list[str]], None] | None = None,
) -> Stopped:
    """Serve the scheduled enrichment of ``runs_root`` and the on-demand flows until interrupted,
    then stop what was served (:func:`stop_served`); returns what stopping touched.

    ``name`` (as ``deploy``'s): another than the default names every served deployment after it,
    so a second serve, of another runs root, shares none with the first. ``serving`` is told the
    deployments' full names once all are registered, as serving begins.

    Example:
        ```python
        serve_shipped("/data/runs", cron="*/5 * * * *", parameters={"max_parallel_runs": 2})
        ```
    """
    for key, value in JOB_VARIABLES["env"].items():  # what a worker's job variables would set
        os.environ.setdefault(key, value)
    deployments = shipped_deployments(
        runs_root, cron=cron, scheduled_parameters=parameters, name=name, served=True
    )
    with get_client(sync_client=True) as client:
        for deployment in deployments:
            try:
                existing = client.read_deployment_by_name(deployment.full_name)
            except ObjectNotFound:
                continue
            if existing.work_pool_name:
                raise NotServed(
                    f"deployment {deployment.full_name} is on work pool {existing.work_pool_name} "
                    "(registered by deploy): serve leaves it alone; delete or rename it first"
                )
    ensure_automations()  # the served ones have the same concurrency limit to explain
    # Prefect's own pause at shutdown pauses by id whatever the deployment has become meanwhile:
    # stop_served pauses only what is still this serve's, and disables the triggers too.
    runner = Runner(pause_on_shutdown=False)
    served = False
    # Ctrl-C; SIGTERM (the runner's own handler exits while it starts, stops it once started).
    with contextlib.suppress(KeyboardInterrupt, TerminationSignal, SystemExit):
        with _stops_held() as stops:  # registered whole (deployments, triggers), then stopped whole
            for deployment in deployments:
                runner.add_deployment(deployment)
        if not stops:
            served = True
            if serving is not None:
                serving([d.full_name for d in deployments])
            asyncio.run(runner.start())
    with _stops_held():  # nor is the stop cut short (a second Ctrl-C waits for it)
        stopped = stop_served(deployments)
    stopped.served = served
    return stopped


@contextlib.contextmanager
def _stops_held() -> Iterator[list[int]]:
    """Ctrl-C and SIGTERM noted, not acted on, within the block (the signals it got, in order): a
    registration cut short leaves a deployment active that nothing serves, or one with no trigger.
    Held only in the main thread (where Python runs signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield []
        return
    noted: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {signum: signal.signal(signum, lambda got, _: noted.append(got)) for signum in held}
    try:
        yield noted
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def stop_served(deployments: list[RunnerDeployment]) -> Stopped:
    """Pause each served deployment that is still a serve's (on no work pool) and disable the
    automations its triggers made (owned by it); leave alone, and name, any now on a work pool."""
    stopped = Stopped()
    with get_client(sync_client=True) as client:
        for deployment in deployments:
            try:
                existing = client.read_deployment_by_name(deployment.full_name)
            except ObjectNotFound:
                continue  # deleted meanwhile: nothing of it left to leave running
            if existing.work_pool_name:
                stopped.left_alone[deployment.full_name] = f"on work pool {existing.work_pool_name}"
                continue
            client.pause_deployment(existing.id)
            stopped.paused.append(deployment.full_name)
            # Its triggers' automations: related to it, named as its triggers (the API does not say
            # which automations a deployment owns; a user's own automation keeps its own name).
            triggers = {getattr(trigger, "name", None) for trigger in deployment.triggers}
            for automation in client.read_resource_related_automations(f"prefect.deployment.{existing.id}"):
                if automation.name not in triggers:
                    continue
                if automation.enabled:
                    client.pause_automation(automation.id)
                stopped.triggers_disabled.append(automation.name)
    return stopped
