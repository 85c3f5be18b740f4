"""``deploy``, ``serve`` and ``finish``: the scheduled enrichment on a Prefect server, and telling it
a run is done."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import typer

from rollout_capture.cli.options import (
    FlowTraces,
    JsonOpt,
    Scheduled,
    Storage,
    addresses_match,
    deploy_name,
    prefect_name,
    printable_input,
    scheduled_options,
    storage_options,
    traces_options,
)
from rollout_capture.cli.output import InputError, Output, show
from rollout_capture.cli.prefect_env import api_url, block_exists, credentials, prefect_env, preflight
from rollout_capture.filesystem import local_path
from rollout_capture.run_events import RUN_FINISHED, RUN_STARTED

if TYPE_CHECKING:
    from rollout_capture.location import Location
    from rollout_capture.run_folders import RunFolder, RunNeeds


def _scheduled(
    storage: Storage, runs_root: str | None, options: Scheduled
) -> tuple[Location, dict[str, Any]]:
    """``deploy`` and ``serve``: the runs root checked (absolute or a URL) and the scheduled flow's
    other parameters; then the API, which both need (a temporary server would forget them)."""
    capture_dir, runner = options.capture_dir, options.runner
    dask_address, ray_address = options.dask_address, options.ray_address
    if not runs_root:
        raise InputError("no runs root: give --runs-root or set ROLLOUT_CAPTURE_RUNS_ROOT")
    printable_input("--runs-root", runs_root, "a runs root the deployment stores")
    printable_input("--capture-dir", capture_dir, "a capture dir the deployment stores")
    local = local_path(runs_root)
    if local is not None and not os.path.isabs(local):
        raise InputError(f"--runs-root must be absolute or a URL (workers resolve it): {runs_root}")
    runs = storage.at(runs_root)  # refused here if bad: every tick would fail
    if capture_dir:
        runs.at(capture_dir)
    addresses_match(runner, dask_address, ray_address)  # the workers have the extras, maybe not here
    parameters: dict[str, Any] = {
        "runner": runner.value,
        "max_workers": options.max_workers,
        "max_parallel_runs": options.max_parallel_runs,
    }
    given = {"capture_dir": capture_dir, "dask_address": dask_address, "ray_address": ray_address}
    parameters.update({key: value for key, value in given.items() if value})
    parameters.update(runs.flow_parameters())
    prefect_env()
    if not api_url():
        raise InputError(
            "deployments live on your Prefect server (one started for this command alone would "
            "forget them): set PREFECT_API_URL first"
        )
    if runs.credentials_block:
        block_exists(runs.credentials_block)
    return runs, parameters


def _names(storage: Storage, traces: FlowTraces) -> None:
    """The blocks ``deploy`` and ``serve`` name: names Prefect stores, checked before any server."""
    prefect_name("--credentials-block", storage.block, block=True)
    prefect_name("--otlp-headers-block", traces.otlp_headers_block, block=True)


@storage_options(captures=False)
@scheduled_options
@traces_options
def deploy(
    storage: Storage,
    scheduled: Scheduled,
    traces: FlowTraces,
    runs_root: Annotated[
        str,
        typer.Option(help="Runs root the schedule enriches, as the workers see it: absolute path or URL."),
    ],
    name: Annotated[
        str,
        typer.Option(
            help="The scheduled deployment's name: one per runs root, several side by side on one server "
            "(never NAME-served: those are serve's)."
        ),
    ] = "enrich-completed-runs",
    pool: Annotated[str, typer.Option(help="Work pool (created as a process pool if missing).")] = (
        "rollout-capture"
    ),
    automation: Annotated[
        bool, typer.Option(help="Also create the shipped automations (once per server).")
    ] = True,
    as_json: JsonOpt = False,
) -> None:
    """Register the shipped deployments on the server PREFECT_API_URL names, from this install.

    Workers need rollout-capture installed (pip install 'rollout-capture[aws]' for S3); the
    entrypoints are module paths, so no code is pushed anywhere. Registering a name again
    updates it in place and says what it replaces.
    """
    out = Output(json=as_json)
    with out.exits():
        deploy_name(name)  # names first: nothing asked of any server for a bad one
        prefect_name("--pool", pool)
        _names(storage, traces)
        _, parameters = _scheduled(storage, runs_root, scheduled)
        parameters.update(traces.parameters())  # the schedule's traces (a Secret block's name only)
        traces.check_block()
        from rollout_capture.deployments.register import register

        done = register(
            runs_root, pool=pool, cron=scheduled.cron, parameters=parameters, automation=automation, name=name
        )

        def registered() -> None:
            show([(name, str(ident)) for name, ident in done["deployments"].items()], ("deployment", "id"))
            for replaced, change in done["replaced"].items():
                typer.echo(
                    f"{replaced}: registered again, {change}"
                    if change == "unchanged"
                    else f"replaced {replaced}: {change}",
                    err=True,
                )
            typer.echo(
                f"work pool {pool}: start a worker with `prefect worker start --pool {pool}`", err=True
            )

        out.result(lambda: {"api": api_url(), **done}, text=registered)


@storage_options(captures=False)
@scheduled_options
@traces_options
def serve(
    storage: Storage,
    scheduled: Scheduled,
    traces: FlowTraces,
    runs_root: Annotated[
        str | None,
        typer.Option(
            envvar="ROLLOUT_CAPTURE_RUNS_ROOT",
            show_envvar=True,
            help="Runs root the schedule enriches (required): absolute path or URL.",
        ),
    ] = None,
    name: Annotated[
        str,
        typer.Option(
            help="The scheduled deployment's name (NAME-served); another than the default also names "
            "the on-demand ones (NAME-enrich-rollouts-served...): one per serve of another runs root."
        ),
    ] = "enrich-completed-runs",
    as_json: JsonOpt = False,
) -> None:
    """Serve deployments of its own (enrich-completed-runs-served...) from this machine until Ctrl-C.

    Never changes what deploy registered; Ctrl-C pauses only the served ones. Needs PREFECT_API_URL.
    """
    out = Output(json=as_json)
    with out.exits():
        prefect_name("--name", name)
        _names(storage, traces)
        runs, parameters = _scheduled(storage, runs_root, scheduled)
        parameters.update(traces.parameters())  # the schedule's traces (a Secret block's name only)
        traces.check_block()
        preflight(folders=[(runs, "runs root")], creates=[runs], prefect=False)  # leases, _ENRICHED
        from rollout_capture.deployments.serve import serve_shipped

        def serving(names: list[str]) -> None:
            typer.echo(f"serving {', '.join(names)} until Ctrl-C", err=True)

        try:
            stopped = serve_shipped(
                runs.url, cron=scheduled.cron, parameters=parameters, name=name, serving=serving
            )
        except KeyboardInterrupt:  # before serve registered anything
            typer.echo("stopped before serving began", err=True)
            raise typer.Exit(130) from None
        if not stopped.served:  # stopped while registering: all it registered is stopped below
            typer.echo("stopped before serving began", err=True)
        typer.echo(f"stopped: paused {', '.join(stopped.paused) or 'nothing'} (this serve's)", err=True)
        if stopped.triggers_disabled:
            typer.echo(f"disabled their triggers: {'; '.join(stopped.triggers_disabled)}", err=True)
        for left, why in stopped.left_alone.items():
            typer.echo(f"left alone {left}: {why}, not this serve's any more", err=True)
        typer.echo("nothing else was touched (deployments of work pools, other serves')", err=True)
        if not stopped.served:
            raise typer.Exit(130)


@dataclass(frozen=True)
class _Said:
    """What ``start`` and ``finish`` tell a run's deployments: the marker they write, the event."""

    verb: str
    event: str
    needs: RunNeeds
    mark: Callable[[str, dict[str, Any] | None, Any], str]
    """Writes the marker without Prefect: (run, storage options, credentials) -> the run."""
    mark_and_tell: str
    """The name of the function of ``rollout_capture.flows.events`` writing it and sending the event."""
    nothing: Callable[[RunFolder], str | None]
    """Why nothing is written or sent for a run as it is (None: something is)."""
    unheard: str
    """What happens anyway when no server is told (no ``PREFECT_API_URL``)."""


def _finished(run: str, options: dict[str, Any] | None, credentials: Any) -> str:
    from rollout_capture.run_folders import mark_finished

    return mark_finished(run, options, credentials=credentials)


def _started(run: str, options: dict[str, Any] | None, credentials: Any) -> str:
    from rollout_capture.run_folders import start_run

    return start_run(run, options, credentials=credentials).url


def _enriched_already(state: RunFolder) -> str | None:
    if state.enriched:
        return (
            f"{state.url} is already enriched (its _ENRICHED): nothing written, nothing sent, "
            "nothing will happen"
        )
    return None


def _begun_already(state: RunFolder) -> str | None:
    if state.enriched or state.finished:
        done = "enriched (its _ENRICHED)" if state.enriched else "finished (its _SUCCESS)"
        return f"{state.url} is already {done}: nothing written, nothing sent, nothing to follow"
    if state.started:
        return f"{state.url} is already started (its _STARTED): nothing written, nothing sent"
    return None


FINISHED = _Said(
    "finished",
    RUN_FINISHED,
    "rollouts",
    _finished,
    "mark_run_finished",
    _enriched_already,
    "a scheduled tick over its runs root enriches it, if a deployment of that root is served or deployed",
)
STARTED = _Said(
    "started",
    RUN_STARTED,
    "any",
    _started,
    "mark_run_started",
    _begun_already,
    "no deployment follows it; follow it yourself (rollout-capture follow RUN)",
)


def _tell(storage: Storage, run: str, out: Output, said: _Said) -> None:
    """Write the run's marker and tell the Prefect server (``start``, ``finish``): the run folder is
    checked before Prefect loads; a plain self-hosted server is told in one request, any other
    through Prefect's client; without ``PREFECT_API_URL`` the marker alone, and it says so."""
    where = storage.at(run)
    resolved = None
    if where.credentials_block:  # the block lives in Prefect's API (none without one: the AWS chain)
        prefect_env()
        if api_url():
            resolved = credentials(where.credentials_block, prefect=False)  # a missing block named, exit 2
    from rollout_capture.run_folders import run_folder

    state, _ = run_folder(where.url, where.storage_options, credentials=resolved, needs=said.needs)
    nothing = said.nothing(state)
    if nothing is not None:
        out.result({"run": state.url, "event_sent": False, "already_enriched": state.enriched}, text=nothing)
        return
    from rollout_capture.run_events import plain_api_url, post_run_event

    plain = None if where.credentials_block else plain_api_url()
    if plain is not None:  # a self-hosted server named in the environment: no Prefect to load
        marked = said.mark(where.url, where.storage_options, None)
        if post_run_event(plain, marked, said.event):
            out.result(
                {"run": marked, "event_sent": True, "already_enriched": False},
                text=f"{said.verb} {marked}: the server was told",
            )
            return
    prefect_env()  # Prefect's client: its settings, its own reports if the server is unreachable
    if not api_url():  # an event on a server started for this command would reach nobody
        marked = said.mark(where.url, where.storage_options, resolved)
        typer.echo(f"no PREFECT_API_URL: no event sent; {said.unheard}", err=True)
        sent = False
    else:
        import importlib

        events = importlib.import_module("rollout_capture.flows.events")
        marked = getattr(events, said.mark_and_tell)(where.url, **where.flow_parameters())
        sent = True
    out.result(
        {"run": marked, "event_sent": sent, "already_enriched": False},
        text=f"{said.verb} {marked}" + (": the server was told" if sent else ""),
    )


@storage_options(captures=False)
def start(
    storage: Storage,
    run: Annotated[
        str, typer.Argument(help="Run folder (<runs_root>/<run>), made if missing on a local disk.")
    ],
    as_json: JsonOpt = False,
) -> None:
    """Mark a run started: write its _STARTED and tell the Prefect server, whose deployments of its
    runs root then follow it while it runs (rollout-capture follow, on a worker or serve). A run
    already started, finished or enriched is left as it is; a folder reached through a link is refused."""
    out = Output(json=as_json)
    with out.exits():
        _tell(storage, run, out, STARTED)


@storage_options(captures=False)
def finish(
    storage: Storage,
    run: Annotated[str, typer.Argument(help="Run folder (<runs_root>/<run>, with its rollouts.jsonl).")],
    as_json: JsonOpt = False,
) -> None:
    """Mark a run finished: write its _SUCCESS and tell the Prefect server, whose deployments of its
    runs root then enrich it at once (without PREFECT_API_URL: their next schedule tick does). An
    enriched run is left as it is; a missing folder, or one reached through a link, is refused."""
    out = Output(json=as_json)
    with out.exits():
        _tell(storage, run, out, FINISHED)
