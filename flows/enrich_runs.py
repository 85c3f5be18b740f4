"""``enrich_completed_runs``: the scheduled job. Every finished, not yet enriched run, once.

The ready runs are cut into batches (``runs_per_batch`` at most, fewer when few runs wait, so
that ``max_parallel_runs`` batches share them), each batch one task run that enriches its runs
in turn, each under its own lease (:mod:`rollout_capture.flows.run_batch`). What Prefect is asked
is per batch: a task run, and a table artifact listing its runs (status, counts, why one failed).
The tick's summary artifact names the runs needing a look and links every batch.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from prefect import get_run_logger
from prefect.futures import PrefectFuture, as_completed
from prefect.runtime import flow_run as this_flow_run
from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import BaseModel, Field

from rollout_capture.enrich_options import DEFAULT_BATCH_SIZE, DEFAULT_MAX_WORKERS, EnrichOptions, Runner
from rollout_capture.filesystem import absolute_location
from rollout_capture.flows.enrich import check_traces
from rollout_capture.flows.guard import StorageOptions, guarded_flow
from rollout_capture.flows.report import (
    Row,
    advance_progress,
    needs_a_look,
    publish_tick_summary,
    show_core_logs,
    start_progress,
    task_run_link,
)
from rollout_capture.flows.run_batch import (
    RunOutcome,
    RunsJob,
    RunStatus,
    enrich_runs_batch,
    hold,
    outcome_row,
)
from rollout_capture.flows.runners import check_runner
from rollout_capture.location import Location
from rollout_capture.quiescence import CAPTURE_DRAIN_TIMEOUT_S
from rollout_capture.run_folders import DEFAULT_LEASE_S, Discovery, RunFolder, new_owner
from rollout_capture.secret_options import shown_url
from rollout_capture.tasks.capture import compact_captures
from rollout_capture.tasks.run_folders import MAX_NAMED_RUNS, find_runs, remember_enriched, runs_root_at

__all__ = ["RunOutcome", "RunStatus", "RunsFailed", "RunsSummary", "enrich_completed_runs"]

DEFAULT_MAX_PARALLEL_RUNS = 4
DEFAULT_RUNS_PER_BATCH = 50
"""Runs a batch task enriches at most: a task run, a log line and a progress step per batch."""


class RunsSummary(BaseModel):
    """Which runs this invocation enriched, skipped or failed on."""

    enriched: list[str] = Field(default_factory=list)
    busy: list[str] = Field(default_factory=list)
    unfinished: list[str] = Field(default_factory=list)
    already_enriched: list[str] = Field(default_factory=list)
    failed: dict[str, str] = Field(default_factory=dict)
    lost: list[str] = Field(default_factory=list)
    """Runs whose lease another holder took while they were enriched (nothing was published)."""
    refused: dict[str, str] = Field(default_factory=dict)
    """Run folders left alone, and why: one holding a link where its parts belong. The tick fails
    naming them, as it does failed runs, and holds them (their ``_REFUSED``)."""
    links: dict[str, str] = Field(default_factory=dict)
    """Names under the root that are links (never followed out of it): named, not run folders."""
    held: dict[str, str] = Field(default_factory=dict)
    """Runs an earlier tick refused for their own input (a link, no captures), and why: named and
    left alone, without failing this tick, until finished again (``finish``) or rechecked."""
    outcomes: dict[str, RunOutcome] = Field(default_factory=dict)
    """Each run this invocation tried to take, by name."""
    compaction: dict[str, str] = Field(default_factory=dict)
    """With ``compact``: each run enriched now, how its captures' compaction went (``compacted``,
    ``already compacted``, ``no journal``, or ``refused: <why>``: left for ``rollout-capture compact``)."""

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
            f"{len(self.failed)} failed, {len(self.refused)} left alone (links), "
            f"{len(self.held)} held (refused before)"
        )


class RunsFailed(RuntimeError):
    """Some runs could not be enriched; the others were."""


def needing_a_look(summary: RunsSummary) -> list[Row]:
    """The rows of the runs the tick's summary names (failed, lost, busy, poor), with their batch's link."""
    rows = [
        {**outcome_row(name, o), "batch": task_run_link(o.task_run_id)}
        for name, o in summary.outcomes.items()
    ]
    left = [
        {**outcome_row(name, RunOutcome(status="failed", error=why)), "status": status, "batch": None}
        for status, named in (
            ("left alone", summary.refused),
            ("held: refused before", summary.held),
            ("a link: left alone", summary.links),
        )
        for name, why in named.items()
    ]
    return [row for row in rows if needs_a_look(row)] + left


def batch_rows(summary: RunsSummary) -> list[Row]:
    """One row per batch of the tick: its runs, how many were enriched or need a look, its task run."""
    batches: dict[str, Row] = {}
    for name, outcome in summary.outcomes.items():
        label = outcome.batch or "-"
        row = batches.setdefault(
            label,
            {
                "batch": label,
                "runs": 0,
                "enriched": 0,
                "notable": 0,
                "link": task_run_link(outcome.task_run_id),
            },
        )
        row["runs"] = int(row["runs"] or 0) + 1
        row["enriched"] = int(row["enriched"] or 0) + (outcome.status == "enriched")
        row["notable"] = int(row["notable"] or 0) + needs_a_look(outcome_row(name, outcome))
    return list(batches.values())


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
    runs_per_batch: Annotated[int, Field(ge=1)] = DEFAULT_RUNS_PER_BATCH,
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
    compact: bool = False,
) -> RunsSummary:
    """Enrich each finished run (``_SUCCESS``, no ``_ENRICHED``) under ``runs_root``, in batches of runs.

    ``_ENRICHED`` is written last, so the next schedule skips the run; a lease keeps overlapping
    schedules off a run (lapsing ``lease_s`` after a crash); a failing run does not stop the others.
    Each batch's table artifact lists its runs, the tick's summary those needing a look; each run's
    events are its own.

    Args:
        runs_root: The folder of runs (path or fsspec URL): <root>/<run>/rollouts.jsonl, captures/, _SUCCESS.
        capture_dir: One capture root for every run; default each run's own captures/ folder.
        include_payloads: Keep each call's request and response in the output.
        quiescence_timeout_s: Seconds to wait, per batch, for calls still being written (live claims).
        batch_size: Rollout lines per batch; a run of more lines runs its batches as tasks.
        max_workers: Batches of lines running at once, per run of more than one batch.
        runner: Where batches run: threads, processes (all cores), dask or ray.
        dask_address: The Dask scheduler (runner=dask); default a local one per run.
        ray_address: The Ray cluster (runner=ray); default RAY_ADDRESS, else local.
        lease_s: Seconds a run's lease lasts without renewal; a crashed tick's run is free after it.
        max_parallel_runs: Runs enriched at once when a backlog waits (a batch of runs each).
        runs_per_batch: Runs a batch task enriches at most, one after another.
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
        compact: Once the tick's runs are enriched, compact each one's journal (its quiet period
            waited out once); a refused one is named in ``compaction`` and left for ``compact``.

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
    options = with_traces_project(options, runs_root)
    check_traces(options)
    captures = runs.at(capture_dir) if capture_dir else None
    summary, ready = _sorted_runs(find_runs(runs, full_scan, recheck))
    _hold_refused(runs, summary.refused)
    job = RunsJob(runs_root=runs, lease_s=lease_s, capture_dir=captures, options=options)
    batches = _batches(ready, runs_per_batch, max_parallel_runs)
    _enrich_ready(summary, ready, job, runs_root, batches, max_parallel_runs)
    if compact:
        _compact_enriched(summary, ready, job)
    _publish_tick(summary, runs_root, runs)
    get_run_logger().info("%s", summary.tally())
    problems = []
    if summary.failed:
        first = dict(list(summary.failed.items())[:MAX_NAMED_RUNS])
        more = len(summary.failed) - len(first)
        tail = f" and {more} more (their batches' tables list them)" if more > 0 else ""
        problems.append(f"{len(summary.failed)} run(s) failed: {first}{tail}")
    if summary.refused:
        first = dict(list(summary.refused.items())[:MAX_NAMED_RUNS])
        more = len(summary.refused) - len(first)
        tail = f" and {more} more (the tick's summary lists them)" if more > 0 else ""
        problems.append(f"{len(summary.refused)} left alone under the runs root: {first}{tail}")
    if problems:
        raise RunsFailed("; ".join(problems))
    return summary


def with_traces_project(options: EnrichOptions, runs_root: str) -> EnrichOptions:
    """Every run of one root in one project: the one named, else the root folder's name."""
    if not options.otlp_endpoint or options.otlp_project:
        return options
    from rollout_capture.traces.runs import runs_project

    return options.model_copy(update={"otlp_project": runs_project(runs_root)})


def _publish_tick(summary: RunsSummary, runs_root: str, runs: Location) -> None:
    """What a tick leaves behind: its summary (in the UI) and the root's index of enriched runs."""
    if summary.outcomes or summary.refused or summary.held or summary.links:
        publish_tick_summary(runs_root, summary.tally(), needing_a_look(summary), batch_rows(summary))
    if summary.enriched:
        remember_enriched(runs, summary.enriched)


def _compact_enriched(summary: RunsSummary, ready: list[RunFolder], job: RunsJob) -> None:
    """Compact the captures of each run enriched now (one task a capture root: runs sharing the
    job's ``capture_dir`` share one), after its output and ``_ENRICHED`` are written: a compaction
    refused or failed leaves the run enriched."""
    enriched = set(summary.enriched)
    roots: dict[str, tuple[Location, list[str]]] = {}
    for run in ready:
        if run.name in enriched:
            root = job.captures_of(run)
            roots.setdefault(root.url, (root, []))[1].append(run.name)
    futures = {url: compact_captures.submit(root, wait_quiet=True) for url, (root, _) in roots.items()}
    for url, future in futures.items():
        names = roots[url][1]
        try:
            done = future.result()
        except Exception as exc:
            outcome = f"failed: {type(exc).__name__}: {exc}"
            get_run_logger().warning("run(s) %s enriched, captures not compacted: %s", ", ".join(names), exc)
        else:
            status = str(done["status"])
            outcome = f"refused: {done['reason']}" if status == "refused" else status
        for name in names:
            summary.compaction[name] = outcome


def _batches(ready: list[RunFolder], runs_per_batch: int, max_parallel_runs: int) -> list[list[RunFolder]]:
    """The ready runs in order, cut into batches of ``runs_per_batch`` at most: fewer per batch when
    few runs wait, so that ``max_parallel_runs`` batches share them."""
    size = max(1, min(runs_per_batch, math.ceil(len(ready) / max_parallel_runs)))
    return [ready[start : start + size] for start in range(0, len(ready), size)]


def _label(batch: list[RunFolder]) -> str:
    """A batch as its task run is named: its first and last run."""
    if len(batch) == 1:
        return batch[0].name
    return f"{batch[0].name} .. {batch[-1].name} ({len(batch)} runs)"


def _enrich_ready(
    summary: RunsSummary,
    ready: list[RunFolder],
    job: RunsJob,
    source: str,
    batches: list[list[RunFolder]],
    max_parallel_runs: int,
) -> None:
    """Each batch through ``enrich_runs_batch``, ``max_parallel_runs`` at once; the tick's progress
    artifact advances as each one ends (by its runs' input bytes when the listing gave their
    sizes, else by runs)."""
    if not batches:
        return
    sized = all(run.rollouts_bytes is not None for run in ready)

    def weight(batch: list[RunFolder]) -> int:
        return sum(run.rollouts_bytes or 0 for run in batch) if sized else len(batch)

    total = sum(weight(batch) for batch in batches)
    progress = start_progress(f"{source} ({len(ready)} runs)", total)
    found: dict[int, list[RunOutcome]] = {}
    done = 0
    pool: ThreadPoolTaskRunner[Any] = ThreadPoolTaskRunner(max_workers=min(max_parallel_runs, len(batches)))
    with pool:
        futures: dict[PrefectFuture[list[RunOutcome]], int] = {
            pool.submit(
                enrich_runs_batch,
                {"runs": batch, "label": _label(batch), "owner": new_owner(), "job": job},
            ): index
            for index, batch in enumerate(batches)
        }
        for future in as_completed(list(futures)):
            index = futures[future]
            found[index] = _outcomes(future, batches[index])
            done += weight(batches[index])
            try:
                advance_progress(progress, f"{source} ({len(ready)} runs)", done, total)
            except Exception as exc:  # shown progress; the batches go on whatever the API says
                get_run_logger().warning("progress not updated: %s", exc)
    for index, batch in enumerate(batches):  # in the runs' order, whichever batch ended first
        for run, outcome in zip(batch, found[index], strict=True):
            summary.record_outcome(run.name, outcome)


def _outcomes(future: PrefectFuture[list[RunOutcome]], batch: list[RunFolder]) -> list[RunOutcome]:
    """A batch's outcomes; a batch that failed as a whole (its own fault, not a run's) fails each run."""
    try:
        return future.result()
    except Exception as exc:
        get_run_logger().error("batch %s failed: %s", _label(batch), exc)
        error = f"{type(exc).__name__}: {exc}"
        return [RunOutcome(status="failed", error=error, task_run_id=future.task_run_id) for _ in batch]


def _hold_refused(runs: Location, refused: dict[str, str]) -> None:
    """Hold the run folders refused now for a link where a part belongs: this tick fails naming
    them, the next ones name them without failing (docs/scheduled.md)."""
    if refused:
        root = runs_root_at(runs)
        for name, why in refused.items():
            hold(root, name, why)


def _sorted_runs(found: Discovery) -> tuple[RunsSummary, list[RunFolder]]:
    """A tick's summary with the runs it skips (enriched, unfinished, left alone) filed, and the
    runs ready."""
    summary = RunsSummary(refused=found.refused, links=found.links, held=found.held)
    ready = []
    for run in found.runs:
        if run.enriched:
            summary.already_enriched.append(run.name)
        elif not run.finished:
            summary.unfinished.append(run.name)
        else:
            ready.append(run)
    return summary, ready
