"""``enrich_completed_runs``: the scheduled job. Every finished, not yet enriched run, once.

Each run is enriched in a subflow of its own (``enrich_run``, named after its folder),
under a lease renewed in the background, several at once when a backlog waits.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any, Literal
from uuid import UUID

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext, TaskRunContext
from prefect.runtime import flow_run as this_flow_run
from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import BaseModel, Field

from rollout_capture.batch import BatchStats
from rollout_capture.enrich_options import DEFAULT_BATCH_SIZE, DEFAULT_MAX_WORKERS, EnrichOptions, Runner
from rollout_capture.filesystem import absolute_location
from rollout_capture.flows.enrich import (
    check_traces,
    enrich_to_spool,
    publish_spool,
    report_enrichment,
    send_traces,
)
from rollout_capture.flows.events import emit_failed
from rollout_capture.flows.guard import StorageOptions, guarded_flow
from rollout_capture.flows.report import EnrichSummary, flow_run_link, publish_runs_table, show_core_logs
from rollout_capture.flows.runners import check_runner
from rollout_capture.location import Location
from rollout_capture.quiescence import CAPTURE_DRAIN_TIMEOUT_S
from rollout_capture.run_folders import (
    DEFAULT_LEASE_S,
    Lease,
    LeaseKeeper,
    LeaseLost,
    RunFolder,
    new_owner,
)
from rollout_capture.secret_options import shown_url
from rollout_capture.tasks.run_folders import (
    fence_run,
    find_runs,
    finish_run,
    release_run,
    remember_enriched,
    runs_root_at,
    take_run,
)

DEFAULT_MAX_PARALLEL_RUNS = 4

RunStatus = Literal["enriched", "busy", "already_enriched", "lost", "failed"]


class RunOutcome(BaseModel):
    """What became of one run this flow run tried to take."""

    status: RunStatus
    flow_run_id: UUID | None = None
    """The run's ``enrich_run`` subflow, when one ran."""
    summary: EnrichSummary | None = None
    error: str | None = None
    state_name: str | None = None
    """The subflow's final state name ("Completed with gaps" when its evidence was poor)."""


class RunsSummary(BaseModel):
    """Which runs this invocation enriched, skipped or failed on."""

    enriched: list[str] = Field(default_factory=list)
    busy: list[str] = Field(default_factory=list)
    unfinished: list[str] = Field(default_factory=list)
    already_enriched: list[str] = Field(default_factory=list)
    failed: dict[str, str] = Field(default_factory=dict)
    lost: list[str] = Field(default_factory=list)
    """Runs whose lease another holder took while they were enriched (nothing was published)."""
    outcomes: dict[str, RunOutcome] = Field(default_factory=dict)
    """Each run this invocation tried to take, by name."""

    def record_outcome(self, name: str, outcome: RunOutcome) -> None:
        """File a run's outcome under its name and in the list of its status."""
        self.outcomes[name] = outcome
        if outcome.status == "failed":
            self.failed[name] = outcome.error or "failed"
        else:
            getattr(self, outcome.status).append(name)

    def tally(self) -> str:
        """How many runs went each way, as the tick's last log line says it."""
        return (
            f"enriched {len(self.enriched)} run(s), {len(self.busy)} busy, {len(self.unfinished)} "
            f"unfinished, {len(self.already_enriched)} already enriched, {len(self.lost)} lost, "
            f"{len(self.failed)} failed"
        )


class RunsFailed(RuntimeError):
    """Some runs could not be enriched; the others were."""


@guarded_flow(name="enrich_run")
def enrich_run(
    runs_root: Location,
    run: RunFolder,
    lease: Lease,
    options: EnrichOptions,
    capture_dir: Location | None = None,
    heartbeat_s: float | None = None,
) -> EnrichSummary:
    """Enrich one run folder whose lease this flow run holds; publish only as its current holder.

    The lease is renewed in the background (every ``lease_s / 3``) however long the run
    takes. The output and ``_ENRICHED`` are each written right after a renewal succeeds,
    so a holder that lost its lease (paused past it, say) stops and publishes nothing.
    The run's files are read and written as ``runs_root`` is (its options, its block).
    """
    show_core_logs()
    # Asked at each use: the lease is renewed for as long as the run takes, past temporary credentials.
    root = runs_root_at(runs_root, renewing=True)
    output = runs_root.at(run.output)
    keeper = LeaseKeeper(root, run, lease, heartbeat_s)
    started = time.perf_counter()
    finished = False
    with _this_flow_runs_context(), keeper:
        try:
            captures = capture_dir or runs_root.at(run.captures)
            done = enrich_to_spool(runs_root.at(run.rollouts), captures, output, options, keeper.check)
            summary = publish_spool(done, run.rollouts, output, started, before=lambda: fence_run(keeper))
            finish_run(keeper, _enriched_marker(summary, done.stats))
            finished = True
        except LeaseLost:
            raise  # another holder has the run: not a failure of its evidence
        except Exception as exc:
            emit_failed(run.rollouts, run.output, exc)
            raise
        finally:
            if not finished:
                _give_back(keeper)
        failed = send_traces(summary, output, options, traces_run(options, run, output))
        end = report_enrichment(summary, options)
    if failed is not None:
        raise failed
    return end  # type: ignore[return-value]  # a named Completed state when the evidence is poor


def traces_run(options: EnrichOptions, run: RunFolder, output: Location) -> str | None:
    """The run a run folder's traces are (docs/contract.md 13): ``<otlp_run_name>/<folder>``
    when the root's runs are named, else its output's location; None when no traces go."""
    if not options.otlp_endpoint:
        return None
    from rollout_capture.traces.runs import folder_run

    return folder_run(options.otlp_run_name, run.name, output.url)


def _enriched_marker(summary: EnrichSummary, stats: BatchStats) -> dict[str, Any]:
    """What ``_ENRICHED`` says: the summary less its problems, the evidence digest, unparseable lines."""
    marker = summary.model_dump(mode="json", exclude={"stats": {"problems", "evidence"}})
    marker["evidence"] = stats.evidence.digest()
    marker["unparseable_lines"] = [p.line for p in stats.problems]
    return marker


@contextmanager
def _this_flow_runs_context() -> Iterator[None]:
    """In a subflow started from a task, forget that task's run context for the flow's body.

    Prefect leaves it set, so the subflow's own logs and artifacts would be filed under
    the parent flow run's task; tasks already ignore a task context of another flow run.
    """
    task_run = TaskRunContext.get()
    flow_run = FlowRunContext.get()
    if task_run is None or flow_run is None or flow_run.flow_run is None:
        yield
        return
    if task_run.task_run.flow_run_id == flow_run.flow_run.id:
        yield
        return
    token = TaskRunContext.__var__.set(None)  # type: ignore[arg-type]  # None reads as "no task run"
    try:
        yield
    finally:
        TaskRunContext.__var__.reset(token)


def _give_back(keeper: LeaseKeeper) -> None:
    """Release after a failure without hiding it: a lease that cannot be released lapses anyway."""
    try:
        release_run(keeper)
    except Exception as exc:
        get_run_logger().warning("%s: lease not released (%s); it lapses by itself", keeper.run.name, exc)


@task(name="enrich_run_folder", task_run_name="enrich_run_folder {run.name}", cache_policy=NO_CACHE)
def enrich_run_folder(
    runs_root: Location,
    run: RunFolder,
    lease_s: float,
    capture_dir: Location | None,
    options: EnrichOptions,
) -> RunOutcome:
    """Take one run and enrich it in its own subflow.

    A task, not a thread of the flow: subflows started from tasks get unique identities,
    so several can run at once. Not retried as a whole: its own tasks retry their faults.
    """
    logger = get_run_logger()
    try:
        taken = take_run(runs_root, run, lease_s, new_owner())
        if taken == "busy":
            logger.info("run %s is being enriched by another flow run; skipped", run.name)
            return RunOutcome(status="busy")
        if taken == "enriched":
            return RunOutcome(status="already_enriched")
        state = enrich_run.with_options(flow_run_name=run.name)(
            runs_root=runs_root,
            run=run,
            lease=taken,
            options=options,
            capture_dir=capture_dir,
            return_state=True,
        )
    except Exception as exc:
        logger.error("run %s failed: %s", run.name, exc)
        return RunOutcome(status="failed", error=f"{type(exc).__name__}: {exc}")
    flow_run_id = state.state_details.flow_run_id
    try:
        summary = state.result()
    except LeaseLost as exc:
        logger.warning("run %s: lease lost, nothing published: %s", run.name, exc)
        return RunOutcome(status="lost", flow_run_id=flow_run_id, error=str(exc))
    except Exception as exc:
        logger.error("run %s failed: %s", run.name, exc)
        return RunOutcome(status="failed", flow_run_id=flow_run_id, error=f"{type(exc).__name__}: {exc}")
    return RunOutcome(status="enriched", flow_run_id=flow_run_id, summary=summary, state_name=state.name)


def runs_rows(summary: RunsSummary) -> list[dict[str, str | int | float]]:
    """One row per run the tick tried: its status, counts, and a link to its subflow run."""
    rows: list[dict[str, str | int | float]] = []
    for name, outcome in summary.outcomes.items():
        enriched = outcome.summary
        stats = enriched.stats if enriched is not None else None
        status: str = outcome.status
        if outcome.state_name and outcome.state_name != "Completed":
            status = f"{status} ({outcome.state_name})"
        rows.append(
            {
                "run": name,
                "status": status,
                "rollouts": stats.rollouts if stats else "-",
                "calls": stats.calls if stats else "-",
                "gap_share": f"{stats.gap_share:.1%}" if stats else "-",
                "failed_calls": stats.evidence.failed_calls if stats else "-",
                "flow_run": flow_run_link(outcome.flow_run_id),
                "error": outcome.error or "",
            }
        )
    return rows


def enrich_runs_name() -> str:
    """``enrich-runs <root>``, the root's absolute path or URL."""
    return f"enrich-runs {shown_url(absolute_location(str(this_flow_run.parameters.get('runs_root', '?'))))}"


@guarded_flow(name="enrich_completed_runs", flow_run_name=enrich_runs_name)
def enrich_completed_runs(
    runs_root: str,
    capture_dir: str | None = None,
    include_payloads: bool = False,
    quiescence_timeout_s: Annotated[float, Field(ge=0)] = CAPTURE_DRAIN_TIMEOUT_S,
    batch_size: Annotated[int, Field(ge=1)] = DEFAULT_BATCH_SIZE,
    max_workers: Annotated[int, Field(ge=1)] = DEFAULT_MAX_WORKERS,
    runner: Runner = "threads",
    dask_address: str | None = None,
    ray_address: str | None = None,
    lease_s: Annotated[float, Field(gt=0)] = DEFAULT_LEASE_S,
    max_parallel_runs: Annotated[int, Field(ge=1)] = DEFAULT_MAX_PARALLEL_RUNS,
    full_scan: bool = False,
    recheck: list[str] | None = None,
    allow_empty: bool = False,
    max_gap_share: Annotated[float, Field(ge=0, le=1)] | None = None,
    storage_options: StorageOptions = None,
    credentials_block: str | None = None,
    max_failed_share: Annotated[float, Field(ge=0, le=1)] | None = None,
    otlp_endpoint: str | None = None,
    otlp_headers_block: str | None = None,
    otlp_project: str | None = None,
    otlp_run_name: str | None = None,
) -> RunsSummary:
    """Enrich each finished run (``_SUCCESS``, no ``_ENRICHED``) under ``runs_root``, each in a subflow.

    ``_ENRICHED`` is written last, so the next schedule skips the run; a lease keeps overlapping
    schedules off a run (lapsing ``lease_s`` after a crash); a failing run does not stop the others.

    Args:
        runs_root: The folder of runs (path or fsspec URL): <root>/<run>/rollouts.jsonl, captures/, _SUCCESS.
        capture_dir: One capture root for every run; default each run's own captures/ folder.
        include_payloads: Keep each call's request and response in the output.
        quiescence_timeout_s: Seconds to wait, per batch, for calls still being written (live claims).
        batch_size: Rollout lines per batch task.
        max_workers: Batches running at once, per run.
        runner: Where batches run: threads, processes (all cores), dask or ray.
        dask_address: The Dask scheduler (runner=dask); default a local one per run.
        ray_address: The Ray cluster (runner=ray); default RAY_ADDRESS, else local.
        lease_s: Seconds a run's lease lasts without renewal; a crashed tick's run is free after it.
        max_parallel_runs: Runs enriched at once when a backlog waits.
        full_scan: List every run folder, ignoring the index of runs already enriched.
        recheck: Names of runs to look at even if the index says they are enriched.
        allow_empty: Accept a run whose capture dir does not exist or holds nothing.
        max_gap_share: Above this share of rollouts with a gap, a run ends "Completed with gaps".
        storage_options: fsspec options for every URL, without secrets (those come from credentials_block).
        credentials_block: Name of a prefect-aws AwsCredentials block to read and write S3 with.
        max_failed_share: Above this share of failed calls, a run ends "Completed with failed calls".
        otlp_endpoint: Send each written output's rollouts as traces to this OTLP/HTTP endpoint (the
            otel extra); checked before any run is taken; a failed export fails the run, output kept.
        otlp_headers_block: Name of a Prefect Secret block holding the endpoint's headers.
        otlp_project: The project every run's traces land in; default the runs root's folder name.
        otlp_run_name: Names the root's runs <otlp_run_name>/<run folder>; default each output's location.

    Examples:
        ```python
        import shutil, tempfile
        from importlib.resources import files
        from pathlib import Path

        from rollout_capture.flows import enrich_completed_runs

        runs = Path(tempfile.mkdtemp())  # a runs root with one finished run, r1
        shutil.copytree(str(files("rollout_capture") / "sample"), runs / "r1")  # rollouts.jsonl, captures/
        (runs / "r1" / "_SUCCESS").touch()
        summary = enrich_completed_runs(str(runs))  # what each scheduled tick runs
        print(summary.enriched)  # ['r1']: r1/rollouts.enriched.jsonl, then r1/_ENRICHED
        print(enrich_completed_runs(str(runs)).already_enriched)  # ['r1']: the next tick skips it
        ```
    """
    options = EnrichOptions.from_parameters(locals())  # first: its locals are its parameters
    show_core_logs()
    check_runner(runner, dask_address, ray_address)
    runs = Location.of(runs_root, storage_options, credentials_block)  # refused here if bad
    options = _with_traces_project(options, runs_root)
    check_traces(options)
    captures = runs.at(capture_dir) if capture_dir else None
    summary, ready = _sorted_runs(find_runs(runs, full_scan, recheck))
    parameters = {"runs_root": runs, "lease_s": lease_s, "capture_dir": captures, "options": options}
    _enrich_ready(summary, ready, parameters, max_parallel_runs)
    _publish_tick(summary, runs_root, runs)
    get_run_logger().info("%s", summary.tally())
    if summary.failed:
        raise RunsFailed(f"{len(summary.failed)} run(s) failed: {summary.failed}")
    return summary


def _with_traces_project(options: EnrichOptions, runs_root: str) -> EnrichOptions:
    """Every run of one root in one project: the one named, else the root folder's name."""
    if not options.otlp_endpoint or options.otlp_project:
        return options
    from rollout_capture.traces.runs import runs_project

    return options.model_copy(update={"otlp_project": runs_project(runs_root)})


def _publish_tick(summary: RunsSummary, runs_root: str, runs: Location) -> None:
    """What a tick leaves behind: its runs table (in the UI) and the root's index of enriched runs."""
    if summary.outcomes:
        publish_runs_table(runs_root, runs_rows(summary))
    if summary.enriched:
        remember_enriched(runs, summary.enriched)


def _enrich_ready(
    summary: RunsSummary, ready: list[RunFolder], parameters: dict[str, Any], max_parallel_runs: int
) -> None:
    """Each ready run through ``enrich_run_folder``, up to ``max_parallel_runs`` at once."""
    if not ready:
        return
    pool: ThreadPoolTaskRunner[Any] = ThreadPoolTaskRunner(max_workers=min(max_parallel_runs, len(ready)))
    with pool:
        futures = [(run, pool.submit(enrich_run_folder, {"run": run, **parameters})) for run in ready]
        for run, future in futures:
            summary.record_outcome(run.name, future.result())


def _sorted_runs(found: Iterable[RunFolder]) -> tuple[RunsSummary, list[RunFolder]]:
    """A tick's summary with the runs it skips (enriched, unfinished) filed, and the runs ready."""
    summary = RunsSummary()
    ready = []
    for run in found:
        if run.enriched:
            summary.already_enriched.append(run.name)
        elif not run.finished:
            summary.unfinished.append(run.name)
        else:
            ready.append(run)
    return summary, ready
