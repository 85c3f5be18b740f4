"""``enrich_rollouts``: stream a rollouts file, merge captures batch by batch, publish atomically."""

from __future__ import annotations

import itertools
import logging
import shutil
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any
from uuid import UUID

from prefect import get_run_logger
from prefect.client.schemas.objects import State
from prefect.futures import PrefectFuture
from prefect.runtime import flow_run
from pydantic import Field

from rollout_capture.backends import ListingScope
from rollout_capture.batch import BatchStats, DuplicateIds
from rollout_capture.enrich_options import DEFAULT_BATCH_SIZE, DEFAULT_MAX_WORKERS, EnrichOptions, Runner
from rollout_capture.faults import NO_CAPTURE_CAUSES
from rollout_capture.filesystem import absolute_location
from rollout_capture.flows.events import emit_completed, emit_failed
from rollout_capture.flows.guard import StorageOptions, guarded_flow
from rollout_capture.flows.report import (
    EnrichSummary,
    advance_progress,
    final_state,
    poor_evidence,
    publish_summary,
    show_core_logs,
    start_progress,
    write_evidence_report,
)
from rollout_capture.flows.runners import (
    REMOTE,
    SHARED_READS_WORKERS,
    api_shared_with_workers,
    check_runner,
    effective_workers,
    make_task_runner,
)
from rollout_capture.location import Location
from rollout_capture.quiescence import CAPTURE_DRAIN_TIMEOUT_S
from rollout_capture.rollout_files import (
    LineRange,
    OutputSpool,
    StagedRollouts,
    default_output,
    iter_line_ranges,
    refuse_unsafe_output,
    remove_staged,
)
from rollout_capture.secret_options import shown_url
from rollout_capture.store import end_scope
from rollout_capture.tasks.capture import (
    BatchInput,
    BatchOutput,
    capture_store,
    check_capture_dir,
    merge_batch,
)
from rollout_capture.tasks.rollout_files import read_rollouts, write_enriched
from rollout_capture.worker_pool import sees_capture_root

logger = logging.getLogger("rollout_capture.flows.enrich")


def listed_capture_ids(captures: Location, scope: ListingScope) -> set[str] | None:
    """The rollout ids under a capture root, from a listing the run already has or that costs little.

    A local root: one ``os.scandir`` of its top level (no stat calls). An object store: the
    flat listing the run's batches shared (never a second listing); ``None`` when the
    batches listed rollout by rollout instead (or in other processes), so none exists here.
    """
    return capture_store(captures).listed_rollout_ids(scope)


def batches_in_flight(workers: int, options: EnrichOptions, captures: Location, scope: ListingScope) -> int:
    """Fewer batches at once where they all read one journal (the root holds it alone): the first
    batch reads every commit for all, so more in flight hold more records and buy no time
    (measured at 10,000 rollouts on a store: 8 as quick as 2, with 871-882 MB peak RSS against
    461-475). Threads only: the job's listing, taken here, is the one its batches share.
    A listing that fails here is left to the batches, which list again, retried as tasks are."""
    if options.runner != "threads" or workers <= SHARED_READS_WORKERS:  # a local disk's are 2 already
        return workers
    try:
        alone = capture_store(captures).journal_alone(scope)
    except Exception as exc:
        logger.info("listing %s before its batches failed (%s): they list it themselves", captures, exc)
        return workers
    if not alone:
        return workers
    logger.info("%s holds a journal alone: %d batches in flight", captures, SHARED_READS_WORKERS)
    return SHARED_READS_WORKERS


def count_orphans(
    stats: BatchStats,
    duplicates: DuplicateIds,
    captures: Location,
    scope: ListingScope,
) -> None:
    """Count (and name the first few) captures under the root that no input line names.

    Evidence, not a fault: a listing that fails is logged and the run goes on.
    """
    try:
        listed = listed_capture_ids(captures, scope)
    except Exception as exc:
        logger.warning("orphan captures not counted: listing %s failed (%s)", captures, exc)
        return
    if listed is None:
        logger.info("orphan captures not counted: %s was listed rollout by rollout", captures)
        return
    duplicates.set_orphans(stats.evidence, listed)
    if stats.evidence.orphan_captures:
        logger.warning(
            "%d capture(s) under %s match no rollout of the input (first: %s)",
            stats.evidence.orphan_captures,
            captures,
            ", ".join(stats.evidence.orphan_examples),
        )


def enrich_run_name() -> str:
    """``enrich <input>``, the input's absolute path or URL: a run names what it read wherever it started."""
    return f"enrich {shown_url(absolute_location(str(flow_run.parameters.get('rollouts', '?'))))}"


@dataclass
class Spooled:
    """An enrichment done but not published: the output complete in a local spool."""

    spool: OutputSpool
    stats: BatchStats
    batches: int


@dataclass
class _SpoolFiller:
    """Merged batches into the spool in input order, with the counts and the progress they add."""

    spool: OutputSpool
    progress: UUID
    source: str
    total_bytes: int
    between_batches: Callable[[], None] | None
    stats: BatchStats = field(default_factory=BatchStats)
    duplicates: DuplicateIds = field(default_factory=DuplicateIds)
    batches: int = 0
    done_bytes: int = 0

    def take(self, size: int, future: PrefectFuture[BatchOutput]) -> None:
        """Spool one batch's output (``size`` input bytes) once its task is done."""
        batch = future.result()
        if batch.part is not None:
            self.spool.append_part(batch.part, batch.lines)
        else:
            self.spool.write(batch.blob, batch.lines)
        batch.blob = b""  # see BatchOutput: Prefect's engine may hold the object a while
        self.duplicates.add(batch.stats)
        self.stats += batch.stats
        self.batches += 1
        self.done_bytes += size
        advance_progress(self.progress, self.source, self.done_bytes, self.total_bytes)
        if self.between_batches is not None:
            self.between_batches()


def _cut(staged: StagedRollouts, batch_size: int, key: str) -> tuple[Iterator[LineRange], ListingScope]:
    """The input's batches, cut lazily (the first run while the rest is scanned), and the listing
    scope with the number of rollouts (for the listing strategy) estimated from the first slice."""
    pieces = iter_line_ranges(staged.path, batch_size)
    first = next(pieces, None)
    if first is None:
        return pieces, ListingScope(key=key, rollouts=0)
    estimate = staged.size * first.lines // max(first.length, 1)
    return itertools.chain([first], pieces), ListingScope(key=key, rollouts=estimate)


def _merge_batches(
    ranges: Iterator[LineRange],
    options: EnrichOptions,
    workers: int,
    parameters: dict[str, Any],
    filler: _SpoolFiller,
) -> None:
    """Submit a ``merge_batch`` per range, at most ``workers`` in flight, spooling each in order."""
    runner = options.runner
    with (
        api_shared_with_workers(runner),
        make_task_runner(runner, workers, options.dask_address, options.ray_address) as task_runner,
    ):
        in_flight: deque[tuple[int, PrefectFuture[BatchOutput]]] = deque()
        try:
            for piece in ranges:
                # Workers elsewhere (Dask, Ray) cannot read this machine's files: they get the bytes.
                blob = piece.read() if runner in REMOTE else None
                batch = {"batch": BatchInput(lines=piece, blob=blob), **parameters}
                in_flight.append((piece.length, task_runner.submit(merge_batch, batch)))
                while len(in_flight) > workers:  # bounded: memory stays flat as input grows
                    filler.take(*in_flight.popleft())
            while in_flight:
                filler.take(*in_flight.popleft())
        except Exception:
            # A cluster's runner cancels what is left when it closes: the batches in flight would
            # stay "Running" in the UI for ever. They end first (at most ``workers``), then the error.
            for _, future in in_flight:
                future.wait()
            raise


def enrich_to_spool(
    rollouts: Location,
    captures: Location,
    target: Location,
    options: EnrichOptions,
    between_batches: Callable[[], None] | None = None,
    staged: StagedRollouts | None = None,
) -> Spooled:
    """Everything of an enrichment but publishing, inside the calling flow run (or task run).

    The caller publishes the spool (or discards it); on failure nothing is left behind.
    ``between_batches`` runs after each batch is spooled and may raise to stop early.
    The batches share one listing of an object-store capture root (this enrichment's scope).
    A local capture dir is made absolute here: batches may run where the working directory differs.
    ``staged``: the input the caller already made local (it is removed here as well).
    """
    check_runner(options.runner, options.dask_address, options.ray_address)
    captures = captures.absolute()
    check_capture_dir(captures, options.allow_empty)
    # Before reading anything: a link there is refused.
    refuse_unsafe_output(target.url, target.storage_options)
    staged = staged or read_rollouts(rollouts)
    source = rollouts.url
    progress = start_progress(source, staged.size)
    filler = _SpoolFiller(
        OutputSpool(target.url, target.storage_options), progress, source, staged.size, between_batches
    )
    parts_dir = tempfile.mkdtemp(prefix="enrich-parts-") if options.runner == "processes" else None
    workers = effective_workers(options.runner, options.max_workers, captures.url)
    # One key per enrichment: the runs of one scheduled tick share its flow run.
    scope = ListingScope(key=f"{flow_run.id or 'local'}-{uuid.uuid4().hex}", rollouts=0)
    try:
        ranges, scope = _cut(staged, options.batch_size, scope.key)
        workers = batches_in_flight(workers, options, captures, scope)
        parameters = {
            "capture_dir": captures,
            "include_payloads": options.include_payloads,
            "quiescence_timeout_s": options.quiescence_timeout_s,
            "source": source,
            "strict": options.strict,
            "worker_processes": workers if options.runner == "processes" else 0,
            "parts_dir": parts_dir,
            "scope": scope,
            # A worker that does not see what this process sees fails its batch, naming itself.
            "capture_root_seen": sees_capture_root(captures.url),
        }
        _merge_batches(ranges, options, workers, parameters, filler)
        stats = filler.duplicates.report(filler.stats, source)
        count_orphans(stats, filler.duplicates, captures, scope)
        filler.spool.close()
    except BaseException:
        filler.spool.discard()
        raise
    finally:
        end_scope(scope.key)
        filler.duplicates.close()
        remove_staged(staged)
        if parts_dir is not None:
            shutil.rmtree(parts_dir, ignore_errors=True)
    return Spooled(spool=filler.spool, stats=stats, batches=filler.batches)


def publish_spool(
    done: Spooled,
    source: str,
    target: Location,
    started: float,
    before: Callable[[], object] | None = None,
    write: Callable[[str, Location, int], object] = write_enriched,
) -> EnrichSummary:
    """Write the spooled output to its target (``before`` it, e.g. a lease's fence) and
    sum up the enrichment; the spool is let go either way. ``write(spool, target, lines)``
    publishes it: the ``write_enriched`` task, or its body where no task run is wanted."""
    try:
        if before is not None:
            before()
        write(done.spool.path, target, done.spool.lines)
    except BaseException:
        done.spool.discard()
        raise
    summary = EnrichSummary(
        source=source,
        output=target.url,
        batches=done.batches,
        seconds=round(time.perf_counter() - started, 3),
        stats=done.stats,
    )
    try:
        summary.report = write_evidence_report(summary, target)
    except Exception as exc:  # derived evidence: the output is published, the run goes on
        get_run_logger().warning("evidence report beside %s not written: %s", target, exc)
    return summary


class TracesExportFailed(RuntimeError):
    """The enriched output is written, but sending its traces failed (the message names the endpoint)."""


def check_traces(options: EnrichOptions) -> None:
    """At a flow's start, before any enrichment: an endpoint that would refuse the traces fails the
    run now, naming the endpoint (never the headers), not after the whole input is enriched."""
    if options.otlp_endpoint:
        from rollout_capture.tasks.traces import check_traces_endpoint

        check_traces_endpoint(
            options.otlp_endpoint, options.otlp_headers_block, options.otlp_project, options.otlp_run_name
        )


def send_traces(
    summary: EnrichSummary, output: Location, options: EnrichOptions, run: str | None = None
) -> TracesExportFailed | None:
    """Export the written output's traces when ``options`` name an endpoint, as the run ``run``
    (default ``options.otlp_run_name``, else the output's location); note what was sent, where
    (project, run), or why not, in ``summary.traces``. A failure is returned, for the flow to end
    Failed with once its summary is published: the output stays written."""
    if not options.otlp_endpoint:
        return None
    from rollout_capture.tasks.traces import export_output_traces
    from rollout_capture.traces.exporter import shown_endpoint, traces_url

    shown = shown_endpoint(traces_url(options.otlp_endpoint))
    try:
        counts = export_output_traces(
            output,
            options.otlp_endpoint,
            options.otlp_headers_block,
            options.include_payloads,
            options.otlp_project,
            run or options.otlp_run_name,
        )
    except Exception as exc:
        summary.traces = f"export to {shown} failed: {exc}"
        return TracesExportFailed(
            f"the enriched output {output} is written, but exporting its traces to {shown} failed: {exc}"
        )
    summary.traces = counts.sent(options.otlp_endpoint)
    return None


def report_enrichment(
    summary: EnrichSummary, options: EnrichOptions, *, artifacts: bool = True, name: str | None = None
) -> State[EnrichSummary] | EnrichSummary:
    """Log what an enrichment found, publish its artifacts, emit its events; return the flow's end.

    Poor evidence (a share past one of ``options``' thresholds) is logged as a WARNING and ends the run in a
    named ``Completed`` state ("Completed with gaps"); otherwise the summary itself is returned.
    ``artifacts=False``: no artifacts of its own (a run of a scheduled tick is a row of its batch's table);
    ``name`` starts its log line (the run's, among the others of its batch).
    """
    logger = get_run_logger()
    stats = summary.stats
    if stats.problems:
        first = stats.problems[0]
        logger.warning(
            "%d line(s) of %s are not rollout records and were passed through (first: line %d: %s)",
            len(stats.problems),
            summary.source,
            first.line,
            first.reason,
        )
    evidence = stats.evidence
    if stats.rollouts and not stats.calls:  # never zero in silence (issue 45)
        logger.warning(
            "%sno call captured for any of %d rollout(s): %s",
            f"{name}: " if name else "",
            stats.rollouts,
            NO_CAPTURE_CAUSES,
        )
    poor = poor_evidence(stats, options.max_gap_share, options.max_failed_share)
    logger.log(
        logging.WARNING if poor else logging.INFO,
        "%s%senriched %d rollout(s) with %d call(s) (%d failed: %s) in %d batch(es); latency p50/p99 %s, "
        "TTFT p50/p99 %s, capture hold p50/p99 %s; tokens in / out / total %s; gaps: %s; orphan captures: %d",
        f"{name}: " if name else "",
        f"poor evidence ({'; '.join(poor)}): " if poor else "",
        stats.rollouts,
        stats.calls,
        evidence.failed_calls,
        "; ".join(
            f"{k} {n} (first: {', '.join(evidence.failure_examples.get(k, []))})"
            for k, n in evidence.calls_by_error_category.items()
        )
        or "none",
        summary.batches,
        evidence.latency_ms.p50_p99("ms"),
        evidence.ttft_ms.p50_p99("ms"),
        evidence.capture_hold_ms.p50_p99("ms"),
        evidence.tokens_line(),
        "; ".join(
            f"{code} {n} (first: {', '.join(evidence.gap_examples.get(code, []))})"
            for code, n in stats.gaps.items()
        )
        or "none",
        evidence.orphan_captures,
    )
    if artifacts:
        publish_summary(summary)
    emit_completed(
        summary.source,
        summary.output,
        stats,
        summary.batches,
        summary.seconds,
        options.max_gap_share,
        options.max_failed_share,
    )
    return final_state(summary, options.max_gap_share, options.max_failed_share)


@guarded_flow(name="enrich_rollouts", flow_run_name=enrich_run_name)
def enrich_rollouts(
    rollouts: str,
    capture_dir: str,
    output: str | None = None,
    include_payloads: bool = False,
    quiescence_timeout_s: Annotated[float, Field(ge=0)] = CAPTURE_DRAIN_TIMEOUT_S,
    batch_size: Annotated[int, Field(ge=1)] = DEFAULT_BATCH_SIZE,
    max_workers: Annotated[int, Field(ge=1)] = DEFAULT_MAX_WORKERS,
    runner: Runner = "threads",
    dask_address: str | None = None,
    ray_address: str | None = None,
    strict: bool = False,
    allow_empty: bool = False,
    max_gap_share: Annotated[float, Field(ge=0, le=1)] | None = None,
    storage_options: StorageOptions = None,
    credentials_block: str | None = None,
    max_failed_share: Annotated[float, Field(ge=0, le=1)] | None = None,
    otlp_endpoint: str | None = None,
    otlp_headers_block: str | None = None,
    otlp_project: str | None = None,
    otlp_run_name: str | None = None,
) -> EnrichSummary:
    """Enrich every rollout of ``rollouts`` (any fsspec URL, ``.gz`` too) with its captured calls.

    Output keeps line order and count and appears only once complete, its report beside it; lines
    that are not rollout records pass through and are reported (``strict`` fails instead).

    Args:
        rollouts: The rollouts JSONL file: a path or any fsspec URL (s3://...), gzip too.
        capture_dir: Where the captures are: a path or fsspec URL.
        output: Where the enriched file goes; default <input stem>.enriched.jsonl beside the input.
        include_payloads: Keep each call's request and response in the output.
        quiescence_timeout_s: Seconds to wait, per batch, for calls still being written (live claims).
        batch_size: Rollout lines per batch task.
        max_workers: Batches running at once, at most (threads: 2 on a local disk, and on an
            object store where they all read one journal).
        runner: Where batches run: threads, processes (all cores), dask or ray.
        dask_address: The Dask scheduler for runner=dask; default a local cluster.
        ray_address: The Ray cluster for runner=ray (head:6379, ray://head:10001); default RAY_ADDRESS.
        strict: Fail on a line that is not a rollout record instead of passing it through.
        allow_empty: Accept a capture dir that does not exist or holds nothing (else the run fails).
        max_gap_share: Above this share of rollouts with a gap, the run ends "Completed with gaps".
        storage_options: fsspec options for every URL, without secrets (those come from credentials_block).
        credentials_block: Name of a prefect-aws AwsCredentials block to read and write S3 with.
        max_failed_share: Above this share of failed calls, the run ends "Completed with failed calls".
        otlp_endpoint: Send the written output's rollouts as traces to this OTLP/HTTP endpoint (the
            otel extra); checked before enriching; a failed export fails the run, output kept.
        otlp_headers_block: Name of a Prefect Secret block holding the endpoint's headers.
        otlp_project: The project the traces land in (Phoenix's); default the endpoint's own.
        otlp_run_name: Names the run in its trace ids; default the output's absolute location.

    Examples:
        Enrich the bundled sample (what ``make demo`` does):

        ```python
        from importlib.resources import files

        from rollout_capture.flows import enrich_rollouts

        sample = files("rollout_capture") / "sample"
        summary = enrich_rollouts(
            str(sample / "rollouts.jsonl"), str(sample / "captures"), output="sample.enriched.jsonl"
        )
        print(summary.stats.rollouts, summary.stats.calls, summary.stats.gaps)
        ```
    """
    options = EnrichOptions.from_parameters(locals())  # first: its locals are its parameters
    show_core_logs()
    target = output or default_output(rollouts)
    started = time.perf_counter()
    try:
        captures = Location.of(capture_dir, storage_options, credentials_block)  # refused here if bad
        check_traces(options)
        output_at = captures.at(target)
        done = enrich_to_spool(captures.at(rollouts), captures, output_at, options)
        summary = publish_spool(done, rollouts, output_at, started)
    except Exception as exc:
        emit_failed(rollouts, target, exc)
        raise
    failed = send_traces(summary, output_at, options)
    # A named Completed state when the evidence is poor; callers still get the summary.
    end = report_enrichment(summary, options)
    if failed is not None:
        raise failed
    return end  # type: ignore[return-value]
