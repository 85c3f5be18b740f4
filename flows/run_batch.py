"""A batch of finished runs enriched in one task run: what the scheduled job costs Prefect per batch.

Each run keeps its own lease (taken, renewed and released as when a run had a subflow of its
own), its own output, evidence report and ``_ENRICHED``, and its own events (``completed``,
``gaps-exceeded``, ``failed``: what automations match); what it no longer has is a flow run,
tasks and artifacts of its own. A run that fits in one batch of lines is merged right here; a
larger one runs its batches as tasks (nested in this one) on the tick's runner.

A failed run never fails its neighbours: its outcome says why. A transient storage fault
makes the whole batch retry (after its neighbours are done), and a retry skips the runs an
earlier try finished (``_ENRICHED`` names this batch's holder id, the same in every try).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, Literal
from uuid import UUID

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import State
from prefect.context import TaskRunContext
from pydantic import BaseModel, ConfigDict, PrivateAttr

from rollout_capture.backends import ListingScope
from rollout_capture.batch import BatchStats, DuplicateIds, enrich_blob
from rollout_capture.enrich_options import EnrichOptions
from rollout_capture.faults import is_transient_storage_error, missing_capture_dir
from rollout_capture.flows.enrich import (
    Spooled,
    count_orphans,
    enrich_to_spool,
    publish_spool,
    report_enrichment,
    send_traces,
)
from rollout_capture.flows.events import emit_failed
from rollout_capture.flows.report import EnrichSummary, Row, poor_state_name, publish_batch_table
from rollout_capture.location import Location
from rollout_capture.rollout_files import (
    LineRange,
    OutputSpool,
    StagedRollouts,
    iter_line_ranges,
    publish,
    refuse_unsafe_output,
    remove_staged,
    stage_rollouts,
)
from rollout_capture.rollout_parts import stage_parts
from rollout_capture.run_folders import LeaseKeeper, LeaseLost, RunFolder, RunsRoot
from rollout_capture.store import end_scope
from rollout_capture.tasks.credentials import credentials_for
from rollout_capture.tasks.retry import storage_retries
from rollout_capture.tasks.rollout_files import write_enriched
from rollout_capture.tasks.run_folders import runs_root_at

RunStatus = Literal["enriched", "busy", "already_enriched", "lost", "failed"]


class RunsJob(BaseModel):
    """What every run of a tick shares: the root they are under, their lease, one capture root
    for all (None: each run's own ``captures/``), and the enrichment's options."""

    model_config = ConfigDict(frozen=True)

    runs_root: Location
    lease_s: float
    capture_dir: Location | None = None
    options: EnrichOptions

    def captures_of(self, run: RunFolder) -> Location:
        """The capture root of ``run``: the job's one, else the run's own ``captures/``."""
        return (self.capture_dir or self.runs_root.at(run.captures)).absolute()


class RunOutcome(BaseModel):
    """What became of one run a tick tried to take: a row of its batch's table.

    The counts are those ``_ENRICHED`` records (``evidence``: its evidence digest), so an
    outcome stays about a kilobyte and a half (never the evidence itself, some 16 KB a run).
    """

    status: RunStatus
    error: str | None = None
    state_name: str | None = None
    """"Completed", or what was poor ("Completed with gaps"), as a run's own flow run ended before."""
    task_run_id: UUID | None = None
    """The batch's task run: the run's row of its table and its logs are there."""
    batch: str | None = None
    """The batch's name (its first and last run)."""
    rollouts: int | None = None
    calls: int | None = None
    rollouts_with_gaps: int | None = None
    failed_calls: int | None = None
    seconds: float | None = None
    output: str | None = None
    report: str | None = None
    evidence: dict[str, Any] | None = None
    """The run's evidence digest (failed calls by category, latency, TTFT, tokens, orphans)."""
    traces: str | None = None
    """What its trace export sent, or why it failed (None: no ``otlp_endpoint``)."""
    _fault: BaseException | None = PrivateAttr(default=None)
    """The storage fault that failed the run, when it may heal: the batch is retried for it."""
    _enrichment_error: BaseException | None = PrivateAttr(default=None)
    """What failed its enrichment (under its lease): told in a ``failed`` event once it is final."""

    @property
    def gap_share(self) -> float | None:
        """The share of the run's rollouts with a gap (None: not enriched)."""
        if self.rollouts is None or self.rollouts_with_gaps is None:
            return None
        return self.rollouts_with_gaps / self.rollouts if self.rollouts else 0.0

    @classmethod
    def of_marker(cls, marker: dict[str, Any], options: EnrichOptions) -> RunOutcome:
        """An enriched run's outcome from what its ``_ENRICHED`` says."""
        stats = marker.get("stats") or {}
        evidence = marker.get("evidence") or {}
        rollouts, gapped = stats.get("rollouts"), stats.get("rollouts_with_gaps")
        gap_share = gapped / rollouts if rollouts else 0.0
        failed_share = float(evidence.get("failed_share") or 0.0)
        poor = poor_state_name(gap_share, failed_share, options.max_gap_share, options.max_failed_share)
        return cls(
            status="enriched",
            state_name=poor or "Completed",
            rollouts=rollouts,
            calls=stats.get("calls"),
            rollouts_with_gaps=gapped,
            failed_calls=evidence.get("failed_calls"),
            seconds=marker.get("seconds"),
            output=marker.get("output"),
            report=marker.get("report"),
            evidence=evidence,
            traces=marker.get("traces"),
        )


def outcome_row(name: str, outcome: RunOutcome) -> Row:
    """A run's row of its batch's table: status (and what was poor), counts, seconds, why it failed."""
    status: str = outcome.status
    if outcome.state_name and outcome.state_name != "Completed":
        status = f"{status} ({outcome.state_name})"
    share = outcome.gap_share
    return {
        "run": name,
        "status": status,
        "rollouts": outcome.rollouts,
        "calls": outcome.calls,
        "gap_share": None if share is None else f"{share:.1%}",
        "failed_calls": outcome.failed_calls,
        "seconds": None if outcome.seconds is None else round(outcome.seconds, 2),
        "error": outcome.error,
    }


class RunsToRetry(RuntimeError):
    """Runs of the batch met a transient storage fault: the batch is retried (the others are done)."""


def enriched_marker(summary: EnrichSummary, stats: BatchStats) -> dict[str, Any]:
    """What ``_ENRICHED`` says: the summary less its problems, the evidence digest, unparseable lines."""
    marker = summary.model_dump(mode="json", exclude={"stats": {"problems", "evidence"}})
    marker["evidence"] = stats.evidence.digest()
    marker["unparseable_lines"] = [p.line for p in stats.problems]
    return marker


def _failed(run: RunFolder, exc: BaseException) -> RunOutcome:
    """A failed run's outcome, logged: an error, or a fault that may heal (the batch retries it)."""
    outcome = RunOutcome(status="failed", error=f"{type(exc).__name__}: {exc}")
    if is_transient_storage_error(exc):
        outcome._fault = exc
        get_run_logger().warning("run %s: a storage fault that may heal: %s", run.name, exc)
    else:
        get_run_logger().error("run %s failed: %s", run.name, exc)
    return outcome


def _publish_here(spool: str, target: Location, lines: int) -> None:
    """Publish a spool without a task run of its own (the batch's task run is the one the UI shows)."""
    with credentials_for(target) as credentials:
        publish(spool, target.url, target.storage_options, credentials=credentials)


def _at_once(
    first: LineRange | None, source: str, captures: Location, output: Location, options: EnrichOptions
) -> Spooled:
    """A run whose lines fit in one batch, merged in this task run: no task, no artifact of its own."""
    scope = ListingScope(key=uuid.uuid4().hex, rollouts=first.lines if first else 0)
    spool = OutputSpool(output.url, output.storage_options)
    try:
        stats = BatchStats()
        if first is not None:
            with credentials_for(captures) as credentials:
                blob, lines, stats = enrich_blob(
                    first.read(),
                    [captures.capture_store(credentials)],
                    include_payloads=options.include_payloads,
                    quiescence_timeout_s=options.quiescence_timeout_s,
                    scope=scope,
                )
            if options.strict and stats.problems:
                raise ValueError(f"{source}:{stats.problems[0].line}: {stats.problems[0].reason}")
            spool.write(blob, lines)
        duplicates = DuplicateIds()
        try:
            duplicates.add(stats)
            stats = duplicates.report(stats, source)
            count_orphans(stats, duplicates, captures, scope)
        finally:
            duplicates.close()
        spool.close()
    except BaseException:
        spool.discard()
        raise
    finally:
        end_scope(scope.key)
    return Spooled(spool=spool, stats=stats, batches=1 if first else 0)


class RunRefused(FileNotFoundError):
    """A run refused for its own input (its capture dir holds nothing): held from the next tick on
    (its ``_REFUSED``), so one such run does not fail every tick over the root."""


def _check_capture_dir(captures: Location, allow_empty: bool, shared: bool) -> None:
    """``check_capture_dir``'s refusal, without its task run. The run's own capture root missing
    is its input's fault (the run held); the job's ``capture_dir`` (``shared``) missing is the
    tick's (a plain failure: held, every run would wait for a ``--recheck`` once it is mended)."""
    with credentials_for(captures) as credentials:
        found = captures.capture_store(credentials).root_found()
    if not found and not allow_empty:
        refusal = missing_capture_dir(captures.url, "allow_empty=True / --allow-empty")
        raise FileNotFoundError(refusal) if shared else RunRefused(refusal)


def _staged(run: RunFolder, rollouts: Location) -> StagedRollouts:
    """The run's rollouts as one local file: its rollouts file, or its parts in order."""
    with credentials_for(rollouts) as credentials:
        if run.parts:
            return stage_parts(run.url, rollouts.storage_options, credentials=credentials)
        return stage_rollouts(rollouts.url, rollouts.storage_options, credentials=credentials)


def _enrich_under_lease(
    run: RunFolder, job: RunsJob, keeper: LeaseKeeper
) -> tuple[EnrichSummary, BatchStats]:
    """The run enriched and published (each write right after a renewal of its lease)."""
    started = time.perf_counter()
    options = job.options
    rollouts, output = job.runs_root.at(run.rollouts), job.runs_root.at(run.output)
    captures = job.captures_of(run)
    _check_capture_dir(captures, options.allow_empty, shared=job.capture_dir is not None)
    refuse_unsafe_output(output.url, output.storage_options)
    staged = _staged(run, rollouts)
    try:
        pieces = iter_line_ranges(staged.path, options.batch_size)
        first = next(pieces, None)
        write: Callable[[str, Location, int], object]
        if next(pieces, None) is None:
            done, write = _at_once(first, run.rollouts, captures, output, options), _publish_here
        else:  # more than one batch of lines: its batches are tasks, on the tick's runner
            done = enrich_to_spool(rollouts, captures, output, options, keeper.check, staged=staged)
            write = write_enriched
    finally:
        remove_staged(staged)
    keeper.check()
    summary = publish_spool(done, run.rollouts, output, started, before=keeper.fence, write=write)
    return summary, done.stats


def hold(root: RunsRoot, name: str, why: str) -> None:
    """Hold a run refused for its own input (a failure to do so is only logged: the next tick
    refuses it again, and fails again)."""
    try:
        root.hold(name, why)
    except Exception as exc:
        get_run_logger().warning("%s: not held (%s); the next tick refuses it again", name, exc)


def _release(root: RunsRoot, name: str) -> None:
    try:
        root.unhold(name)
    except Exception as exc:
        get_run_logger().warning("%s: its _REFUSED stays (%s); finish it again to drop it", name, exc)


def _give_back(keeper: LeaseKeeper) -> None:
    """Release after a failure without hiding it: a lease that cannot be released lapses anyway."""
    try:
        keeper.release()
    except Exception as exc:
        get_run_logger().warning("%s: lease not released (%s); it lapses by itself", keeper.run.name, exc)


def enrich_one_run(
    root: RunsRoot, run: RunFolder, owner: str, job: RunsJob, *, artifacts: bool = False
) -> RunOutcome:
    """Take one run and enrich it, publishing only as the current holder of its lease (``owner``
    taking it again adopts the lease it holds: a follower's end, a retry).

    Never raises for the run's own failure (its outcome says it), so its neighbours go on.
    ``artifacts``: the enrichment's own artifacts (a flow run of its own: a followed run), not a
    row of a batch's table.
    """
    logger = get_run_logger()
    try:
        taken = root.take(run, job.lease_s, owner)
    except Exception as exc:
        return _failed(run, exc)
    if taken == "busy":
        logger.info("run %s is being enriched by another flow run; skipped", run.name)
        return RunOutcome(status="busy")
    if taken == "enriched":
        marker = root.enriched_marker(run)
        if marker is not None and marker.get("enriched_by") == owner:  # this batch's earlier try
            root.drop_leases(run)  # had that try's finish failed after the marker, they would stay
            return RunOutcome.of_marker(marker, job.options)
        return RunOutcome(status="already_enriched")
    keeper = LeaseKeeper(root, run, taken)
    finished = False
    with keeper:
        try:
            summary, stats = _enrich_under_lease(run, job, keeper)
            marker = enriched_marker(summary, stats)
            keeper.finish(marker)
            finished = True
        except LeaseLost as exc:  # another holder has the run: not a failure of its evidence
            logger.warning("run %s: lease lost, nothing published: %s", run.name, exc)
            return RunOutcome(status="lost", error=str(exc))
        except Exception as exc:
            outcome = _failed(run, exc)
            outcome._enrichment_error = exc
            if isinstance(exc, RunRefused):
                hold(root, run.name, str(exc))
            return outcome
        finally:
            if not finished:
                _give_back(keeper)
    if run.held:  # rechecked and enriched after all
        _release(root, run.name)
    output = job.runs_root.at(run.output)
    failed = send_traces(summary, output, job.options, traces_run(job.options, run, output))
    end = report_enrichment(summary, job.options, artifacts=artifacts, name=run.name)
    outcome = RunOutcome.of_marker({**marker, "traces": summary.traces}, job.options)
    outcome.state_name = end.name if isinstance(end, State) else "Completed"
    if failed is not None:
        logger.error("run %s failed: %s", run.name, failed)
        outcome.status, outcome.error = "failed", f"{type(failed).__name__}: {failed}"
    return outcome


def traces_run(options: EnrichOptions, run: RunFolder, output: Location) -> str | None:
    """The run a run folder's traces are (docs/contract.md 13): ``<otlp_run_name>/<folder>``
    when the root's runs are named, else its output's location; None when no traces go."""
    if not options.otlp_endpoint:
        return None
    from rollout_capture.traces.runs import folder_run

    return folder_run(options.otlp_run_name, run.name, output.url)


def last_try() -> bool:
    """Whether this task run has no retry left (then failures are reported, not retried)."""
    context = TaskRunContext.get()
    if context is None:
        return True
    return context.task_run.run_count > (context.task.retries or 0)


@task(
    name="enrich_runs_batch",
    task_run_name="enrich_runs {label}",
    cache_policy=NO_CACHE,
    persist_result=False,
    **storage_retries(),
)
def enrich_runs_batch(runs: list[RunFolder], label: str, owner: str, job: RunsJob) -> list[RunOutcome]:
    """Enrich each run of the batch in turn, under its own lease; one outcome per run, in order.

    ``owner`` is the batch's holder id, the same in each try. A run that failed on a transient
    storage fault makes the batch raise once the others are done, so Prefect retries it; on
    its last try every failure is an outcome. Not for direct use: ``enrich_completed_runs`` cuts
    its runs into these.
    """
    logger = get_run_logger()
    root = runs_root_at(job.runs_root, renewing=True)
    context = TaskRunContext.get()
    task_run_id = context.task_run.id if context is not None else None
    last = last_try()
    outcomes = []
    for run in runs:
        outcome = enrich_one_run(root, run, owner, job)
        outcome.task_run_id, outcome.batch = task_run_id, label
        outcomes.append(outcome)
    faults = {run.name: o for run, o in zip(runs, outcomes, strict=True) if o._fault is not None}
    for run, outcome in zip(runs, outcomes, strict=True):  # final failures: automations hear of them
        error = outcome._enrichment_error
        if error is not None and (last or outcome._fault is None):
            emit_failed(run.rollouts, run.output, error)
    if faults and last:
        for name, outcome in faults.items():
            logger.error("run %s failed, no retry left: %s", name, outcome.error)
    elif faults:
        raise RunsToRetry(
            f"{len(faults)} run(s) of {label} met a transient storage fault; the batch is retried "
            f"(its finished runs skipped): {', '.join(f'{n}: {o.error}' for n, o in faults.items())}"
        ) from next(iter(faults.values()))._fault
    done = sum(o.status == "enriched" for o in outcomes)
    headline = f"{done} of {len(runs)} run(s) enriched"
    publish_batch_table(
        label, [outcome_row(run.name, o) for run, o in zip(runs, outcomes, strict=True)], headline
    )
    logger.info("%s: %s", label, headline)
    return outcomes
