"""``follow_run``: a run followed while it runs, then published as post-run enrichment publishes it.

The flow takes the run's lease (the lease the scheduled job takes: a tick that reaches the run
finds it busy) and holds it throughout. While the run runs, each record is enriched once its
captures are quiescent and written to the live output (:mod:`rollout_capture.following`); the
flow run shows the progress and the evidence so far, updated in place, and sends ``gaps-exceeded``
and ``failed-calls-exceeded`` when a share crosses its threshold. Once the run has finished and
every line is live, the end is post-run enrichment itself (:func:`~rollout_capture.flows.run_batch.
enrich_held_run`, under the same lease): the published output, its report and ``_ENRICHED`` are
what a tick would have published, and a record whose captures changed after it was enriched live
(a late row) is published as it is now, never as it was. Stopped (Ctrl-C), it gives the lease back
and says where it stood; killed, the next follower goes on from its live output.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Annotated, Literal

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.states import Completed
from pydantic import BaseModel, Field

from rollout_capture.backends import Backend
from rollout_capture.call_records_fast import Untyped
from rollout_capture.enrich_options import DEFAULT_BATCH_SIZE, DEFAULT_MAX_WORKERS, EnrichOptions, Runner
from rollout_capture.filesystem import absolute_location, local_path, open_filesystem
from rollout_capture.flows.enrich import check_traces
from rollout_capture.flows.enrich_runs import with_traces_project
from rollout_capture.flows.events import LiveThresholds, emit_failed
from rollout_capture.flows.guard import StorageOptions, guarded_flow
from rollout_capture.flows.report import LiveView, show_core_logs
from rollout_capture.flows.run_batch import RunOutcome, RunsJob, enrich_one_run, last_try
from rollout_capture.flows.runners import check_runner
from rollout_capture.following import (
    LOCAL_POLL_S,
    LOCAL_STATE_S,
    STORE_POLL_S,
    STORE_STATE_S,
    Follower,
    FollowProgress,
    FollowSettings,
    line_digest,
)
from rollout_capture.identity_fast import identify_line
from rollout_capture.live_output import LiveFile, LiveOutput, LiveOutputTaken, LiveParts
from rollout_capture.location import Location
from rollout_capture.quiescence import CAPTURE_DRAIN_TIMEOUT_S
from rollout_capture.rollout_tail import RunRollouts
from rollout_capture.run_folders import (
    DEFAULT_LEASE_S,
    LIVE,
    LeaseKeeper,
    LeaseLost,
    RunFolder,
    new_owner,
    run_folder,
)
from rollout_capture.secret_options import shown_url
from rollout_capture.tasks.credentials import credentials_from_block
from rollout_capture.tasks.retry import storage_retries
from rollout_capture.tasks.run_folders import runs_root_at

FollowStatus = Literal["published", "already_enriched", "busy", "stopped", "lost", "failed"]
STOP = threading.Event()
"""Set to stop every follower of this process after the round in hand (``rollout-capture follow``'s
Ctrl-C): each gives its lease back and says where it stood."""
MAX_LATE_EXAMPLES = 10


class FollowSummary(BaseModel):
    """How following a run ended, and where it stood."""

    run: str
    status: FollowStatus
    message: str
    """Where it stood, in a sentence (what ``rollout-capture follow`` prints)."""
    live_output: str | None = None
    landed: int = 0
    """Lines of the run's rollouts read."""
    live: int = 0
    """Lines in the live output."""
    resumed: int = 0
    """Lines an earlier follower had made live."""
    waiting_on: list[str] = Field(default_factory=list)
    """Rollouts whose live claims held the next line when it stopped."""
    late: int | None = None
    """Lines whose published enrichment differs from their live one (captures changed since)."""
    late_examples: list[str] = Field(default_factory=list)
    """The first such rollouts."""
    live_events: list[str] = Field(default_factory=list)
    """Events sent mid-run (``gaps-exceeded``, ``failed-calls-exceeded``)."""
    holder: str | None = None
    """The lease's holder, when another follower (or a tick) has the run."""
    outcome: RunOutcome | None = None
    """The end, as post-run enrichment tells it (status, output, report, counts, the evidence digest)."""


def follow_run_name() -> str:
    """``follow <run>``, the run folder's absolute path or URL."""
    return f"follow {shown_url(absolute_location(str(flow_run.parameters.get('run', '?'))))}"


def stop_following() -> None:
    """Stop every follower of this process after the round in hand (what Ctrl-C does)."""
    STOP.set()


@guarded_flow(name="follow_run", flow_run_name=follow_run_name)
def follow_run(
    run: str,
    capture_dir: str | None = None,
    include_payloads: bool = False,
    quiescence_timeout_s: Annotated[float, Field(ge=0)] = CAPTURE_DRAIN_TIMEOUT_S,
    lease_s: Annotated[float, Field(gt=0)] = DEFAULT_LEASE_S,
    batch_size: Annotated[int, Field(ge=1)] = DEFAULT_BATCH_SIZE,
    max_workers: Annotated[int, Field(ge=1)] = DEFAULT_MAX_WORKERS,
    runner: Runner = "threads",
    dask_address: str | None = None,
    ray_address: str | None = None,
    allow_empty: bool = False,
    max_gap_share: Annotated[float, Field(ge=0, le=1)] | None = None,
    max_failed_share: Annotated[float, Field(ge=0, le=1)] | None = None,
    storage_options: StorageOptions = None,
    credentials_block: str | None = None,
    otlp_endpoint: str | None = None,
    otlp_headers_block: str | None = None,
    otlp_project: str | None = None,
    otlp_run_name: str | None = None,
) -> FollowSummary:
    """Follow a run while it runs: each record enriched within seconds of landing, then the run
    published as post-run enrichment publishes it once it has finished.

    Each record is enriched once its captures are quiescent (claims released, or its quiescence
    timeout passed: the pending gap) and appended to the run's live output in the order the
    records landed (``rollouts.enriched.live.jsonl`` on a local disk, parts under
    ``rollouts.enriched.live/`` on an object store). The run's lease is held throughout. Once the
    run has finished (``_SUCCESS``) it is enriched and published as a scheduled tick would
    (``rollouts.enriched.jsonl``, its report, ``_ENRICHED``), once.

    Args:
        run: The run folder (path or fsspec URL): rollouts.jsonl or rollouts.parts/, captures/.
        capture_dir: Where the captures are; default the run's own captures/ folder.
        include_payloads: Keep each call's request and response in the output.
        quiescence_timeout_s: Seconds a record waits for its calls still being written (live claims).
        lease_s: Seconds the run's lease lasts without renewal; a killed follower's run is free after it.
        batch_size: Rollout lines enriched at most per round (and per batch at the end).
        max_workers: Batches of lines running at once at the end, for a run of more than one batch.
        runner: Where the end's batches run: threads, processes (all cores), dask or ray.
        dask_address: The Dask scheduler (runner=dask).
        ray_address: The Ray cluster (runner=ray).
        allow_empty: Accept a capture dir that does not exist or holds nothing at the end.
        max_gap_share: Above this share of rollouts with a gap, gaps-exceeded (mid-run too).
        storage_options: fsspec options for every URL, without secrets (those come from credentials_block).
        credentials_block: Name of a prefect-aws AwsCredentials block to read and write S3 with.
        max_failed_share: Above this share of failed calls, failed-calls-exceeded (mid-run too).
        otlp_endpoint: Send the published output's rollouts as traces to this OTLP/HTTP endpoint.
        otlp_headers_block: Name of a Prefect Secret block holding the endpoint's headers.
        otlp_project: The project the traces land in; default the runs root's folder name.
        otlp_run_name: Names the root's runs <otlp_run_name>/<run folder>; default the output's location.

    Examples:
        A run that has finished already is followed to its end at once (a started one would be
        followed until its ``_SUCCESS``):

        ```python
        import shutil
        import tempfile
        from importlib.resources import files
        from pathlib import Path

        from rollout_capture.flows import follow_run

        run = Path(tempfile.mkdtemp()) / "r1"  # a run folder: rollouts.jsonl, captures/
        shutil.copytree(str(files("rollout_capture") / "sample"), run)
        (run / "_SUCCESS").touch()
        summary = follow_run(str(run))  # returns once r1 is published
        print(summary.status, summary.live, summary.late)  # published 12 0
        ```
    """
    options = EnrichOptions.from_parameters(locals())  # first: its locals are its parameters
    show_core_logs()
    check_runner(runner, dask_address, ray_address)
    where = Location.of(run, storage_options, credentials_block).absolute()  # refused here if bad
    state, folder = run_folder(
        where.url, storage_options, credentials=credentials_from_block(credentials_block), needs="started"
    )
    parent = state.url.rsplit("/", 1)[0]
    options = with_traces_project(options, parent)
    check_traces(options)
    runs = where.at(parent)
    root = runs_root_at(runs, renewing=True)
    if state.enriched:
        return _said(
            state, "already_enriched", f"{state.url} is enriched already (its _ENRICHED): nothing to follow"
        )
    taken = root.take(state, lease_s, new_owner())
    if taken == "enriched":
        return _said(state, "already_enriched", f"{state.url} was enriched meanwhile: nothing to follow")
    if taken == "busy":
        lease = root.current_lease(state)
        holder = lease.owner if lease is not None else "another holder"
        summary = _said(
            state, "busy", f"{state.url} is followed or enriched by {holder} (its lease): nothing done here"
        )
        summary.holder = holder
        return summary
    keeper = LeaseKeeper(root, state, taken).start()
    job = RunsJob(
        runs_root=runs,
        lease_s=lease_s,
        capture_dir=runs.at(capture_dir) if capture_dir else None,
        options=options,
    )
    try:
        end = _follow(state, folder, keeper, job)
    except (LeaseLost, LiveOutputTaken) as exc:
        keeper.stop()
        message = f"{state.url}: another follower took the run over ({exc}); this one wrote nothing more"
        get_run_logger().warning("%s", message)
        return FollowSummary(run=state.url, status="lost", message=message)
    except BaseException:
        _release(keeper)
        raise
    if isinstance(end, FollowSummary):  # stopped: the lease is given back
        _release(keeper)
        return Completed(name="Stopped", message=end.message, data=end)  # type: ignore[return-value]
    follower, thresholds, live_output = end
    keeper.stop()  # the end adopts this lease (the same holder), renewing it
    return _publish(state, keeper.lease.owner, job, follower, thresholds, live_output)


def _said(state: RunFolder, status: FollowStatus, message: str) -> FollowSummary:
    get_run_logger().info("%s", message)
    return FollowSummary(run=state.url, status=status, message=message)


def _follow(
    state: RunFolder, folder: Backend, keeper: LeaseKeeper, job: RunsJob
) -> FollowSummary | tuple[Follower, LiveThresholds, str]:
    """Follow the run under the lease ``keeper`` holds, until it has finished and every line is
    live (the follower, its thresholds, its live output), or until stopped (where it stood)."""
    runs, options = job.runs_root, job.options
    credentials = credentials_from_block(runs.credentials_block)
    local = local_path(state.url)
    live: LiveOutput = LiveFile(f"{local}/{LIVE}") if local is not None else LiveParts(folder, state.url)
    tail = RunRollouts(folder, state.url, runs.storage_options, credentials=credentials)
    captures = (job.capture_dir or runs.at(state.captures)).absolute()
    settings = FollowSettings(
        include_payloads=options.include_payloads,
        quiescence_timeout_s=options.quiescence_timeout_s,
        batch_size=options.batch_size,
        poll_s=LOCAL_POLL_S if local is not None else STORE_POLL_S,
        state_s=LOCAL_STATE_S if local is not None else STORE_STATE_S,
    )
    view = LiveView(state.url, live.where)
    thresholds = LiveThresholds(state.rollouts, state.output, options.max_gap_share, options.max_failed_share)
    started = time.perf_counter()

    def shown(progress: FollowProgress) -> None:
        view.update(progress)
        thresholds.check(progress.stats, round(time.perf_counter() - started, 3))

    follower = Follower(
        folder,
        tail,
        live,
        lambda: [captures.capture_store(credentials_from_block(captures.credentials_block))],
        settings,
        check=keeper.check,
        stop=STOP,
        on_progress=shown,
    )
    get_run_logger().info("following %s: its live output is %s", state.url, live.where)
    try:
        end = follower.run()
    finally:
        live.close()
        tail.close()
    view.update(follower.progress, now=True)
    if end == "stopped":
        message = stood(state.url, live.where, follower.progress)
        get_run_logger().warning("%s", message)
        return _standing(state, "stopped", message, follower, live.where, thresholds)
    return follower, thresholds, live.where


def _publish(
    state: RunFolder,
    owner: str,
    job: RunsJob,
    follower: Follower,
    thresholds: LiveThresholds,
    live_output: str,
) -> FollowSummary:
    """The finished run published by post-run enrichment (its task, retried on storage faults),
    then its published lines compared with their live ones."""
    logger = get_run_logger()
    logger.info(
        "%s has finished: %d line(s) live; publishing it as post-run enrichment does",
        state.url,
        follower.progress.live,
    )
    credentials = credentials_from_block(job.runs_root.credentials_block)
    finished, _ = run_folder(state.url, job.runs_root.storage_options, credentials=credentials)
    outcome = publish_followed_run(finished, owner, job)
    summary = _standing(state, "published", "", follower, live_output, thresholds)
    summary.outcome = outcome
    if outcome.status != "enriched" or outcome.output is None:
        summary.status = "failed" if outcome.status == "failed" else "lost"
        why = outcome.error or outcome.status
        summary.message = f"{state.url}: followed to its end, but not published by this follower: {why}"
        if summary.status == "failed":
            raise FollowFailed(summary.message)
        logger.warning("%s", summary.message)
        return summary
    late, examples = late_lines(follower.digests, outcome.output, job.runs_root)
    summary.late, summary.late_examples = late, examples
    changed = (
        f"; {late:,} enriched again at the end, their captures changed since (first: {', '.join(examples)})"
    )
    summary.message = (
        f"{state.url}: published {outcome.output} ({follower.progress.live:,} line(s) live first"
        + (changed if late else "")
        + ")"
    )
    (logger.warning if late else logger.info)("%s", summary.message)
    return summary


class FollowFailed(RuntimeError):
    """A followed run could not be published (its outcome names why)."""


@task(
    name="publish_followed_run",
    task_run_name="publish {run.name}",
    cache_policy=NO_CACHE,
    persist_result=False,
    **storage_retries(),
)
def publish_followed_run(run: RunFolder, owner: str, job: RunsJob) -> RunOutcome:
    """The followed run's end: post-run enrichment of it (:func:`enrich_one_run`, adopting the lease
    its follower holds), with its own artifacts; a transient storage fault retries it."""
    root = runs_root_at(job.runs_root, renewing=True)
    outcome = enrich_one_run(root, run, owner, job, artifacts=True)
    if outcome._fault is not None and not last_try():
        raise outcome._fault
    if outcome._enrichment_error is not None:
        emit_failed(run.rollouts, run.output, outcome._enrichment_error)
    return outcome


def _release(keeper: LeaseKeeper) -> None:
    try:
        keeper.release()
    except Exception as exc:
        get_run_logger().warning("%s: lease not released (%s); it lapses by itself", keeper.run.name, exc)


def stood(run: str, live_output: str, progress: FollowProgress) -> str:
    """Where a stopped follower stood, in a sentence."""
    waiting = ""
    if progress.waiting:
        waiting = f"; {progress.waiting:,} line(s) read but not live yet"
        if progress.waiting_on:
            waiting += f" (waiting on the claims of {', '.join(progress.waiting_on[:3])})"
    return (
        f"stopped following {run}: {progress.live:,} line(s) live in {live_output}{waiting}; its lease "
        f"is given back, and following it again goes on from line {progress.live + 1:,}"
    )


def _standing(
    state: RunFolder,
    status: FollowStatus,
    message: str,
    follower: Follower,
    live_output: str,
    thresholds: LiveThresholds,
) -> FollowSummary:
    progress = follower.progress
    return FollowSummary(
        run=state.url,
        status=status,
        message=message,
        live_output=live_output,
        landed=progress.landed,
        live=progress.live,
        resumed=progress.resumed,
        waiting_on=progress.waiting_on,
        live_events=list(thresholds.sent),
    )


def late_lines(digests: Sequence[int], output: str, runs: Location) -> tuple[int, list[str]]:
    """How many published lines differ from their live ones, and the first rollouts among them."""
    late, examples = 0, list[str]()
    for number, line in enumerate(_published_lines(output, runs)):
        if number < len(digests) and digests[number] == line_digest(line):
            continue
        late += 1
        if len(examples) < MAX_LATE_EXAMPLES:
            examples.append(_named(line, number + 1))
    return late, examples


def _named(line: bytes, number: int) -> str:
    """A published line as a late one is named: its rollout id, else its number."""
    try:
        found = identify_line(line)
    except Untyped:
        found = None
    return found[0] if found else f"line {number:,}"


def _published_lines(output: str, runs: Location) -> Iterator[bytes]:
    credentials = credentials_from_block(runs.credentials_block)
    fs, path = open_filesystem(output, runs.storage_options, credentials=credentials)
    with fs.open(path, "rb") as handle:
        for line in handle:
            yield line.rstrip(b"\n")
