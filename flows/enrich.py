"""``enrich_rollouts``: stream a rollouts file, merge captures batch by batch, publish atomically."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefect import get_run_logger
from prefect.futures import PrefectFuture

from flows.guard import check_inputs, guarded_flow
from flows.report import EnrichSummary, advance_progress, publish_summary, start_progress
from flows.runners import Runner, api_shared_with_workers, effective_workers, make_task_runner
from rollout_capture.batch import BatchStats
from rollout_capture.quiescence import CAPTURE_DRAIN_TIMEOUT_S
from rollout_capture.rollout_files import OutputSpool, default_output, iter_line_batches, remove_staged
from tasks.capture import BatchInput, BatchOutput, merge_batch
from tasks.rollout_files import read_rollouts, write_enriched

DEFAULT_BATCH_SIZE = 1000


@dataclass
class Spooled:
    """An enrichment done but not published: the output complete in a local spool."""

    spool: OutputSpool
    stats: BatchStats
    batches: int


def enrich_to_spool(
    rollouts: str,
    capture_dir: str,
    target: str,
    *,
    include_payloads: bool,
    quiescence_timeout_s: float,
    batch_size: int,
    max_workers: int,
    runner: Runner,
    dask_address: str | None,
    strict: bool,
    storage_options: dict[str, Any] | None,
    credentials_block: str | None,
    between_batches: Callable[[], None] | None = None,
) -> Spooled:
    """Everything of an enrichment but publishing, inside the calling flow run.

    The caller publishes the spool (or discards it); on failure nothing is left behind.
    ``between_batches`` runs after each batch is spooled and may raise to stop early.
    """
    staged = read_rollouts(rollouts, storage_options, credentials_block)
    progress = start_progress(rollouts, staged.size)
    spool = OutputSpool(target, storage_options)
    stats = BatchStats()
    batches = done_bytes = 0
    workers = effective_workers(runner, max_workers, capture_dir)
    options = {
        "capture_dir": capture_dir,
        "storage_options": storage_options,
        "credentials_block": credentials_block,
        "include_payloads": include_payloads,
        "quiescence_timeout_s": quiescence_timeout_s,
        "source": rollouts,
        "strict": strict,
        "worker_processes": workers if runner == "processes" else 0,
    }
    try:
        with (
            api_shared_with_workers(runner),
            make_task_runner(runner, workers, dask_address) as task_runner,
        ):
            in_flight: deque[tuple[int, PrefectFuture[BatchOutput]]] = deque()

            def collect() -> None:
                nonlocal stats, batches, done_bytes
                size, future = in_flight.popleft()
                batch = future.result()
                spool.write(batch.blob, batch.lines)
                batch.blob = b""  # see BatchOutput: Prefect's engine may hold the object a while
                stats += batch.stats
                batches += 1
                done_bytes += size
                advance_progress(progress, done_bytes, staged.size)
                if between_batches is not None:
                    between_batches()

            for first_line, blob in iter_line_batches(staged.path, batch_size):
                parameters = {"batch": BatchInput(blob=blob, first_line=first_line), **options}
                in_flight.append((len(blob), task_runner.submit(merge_batch, parameters)))
                while len(in_flight) > workers:  # bounded: memory stays flat as input grows
                    collect()
            while in_flight:
                collect()
        spool.close()
    except BaseException:
        spool.discard()
        raise
    finally:
        remove_staged(staged)
    return Spooled(spool=spool, stats=stats, batches=batches)


def report_enrichment(summary: EnrichSummary) -> None:
    """Log what an enrichment found and publish its table and summary artifacts."""
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
    logger.info(
        "enriched %d rollout(s) with %d call(s) in %d batch(es); gaps: %s",
        stats.rollouts,
        stats.calls,
        summary.batches,
        stats.gaps or "none",
    )
    publish_summary(summary)


@guarded_flow(name="enrich_rollouts")
def enrich_rollouts(
    rollouts: str,
    capture_dir: str,
    output: str | None = None,
    include_payloads: bool = False,
    quiescence_timeout_s: float = CAPTURE_DRAIN_TIMEOUT_S,
    batch_size: int = DEFAULT_BATCH_SIZE,
    max_workers: int = 8,
    runner: Runner = "threads",
    dask_address: str | None = None,
    strict: bool = False,
    storage_options: dict[str, Any] | None = None,
    credentials_block: str | None = None,
) -> EnrichSummary:
    """Enrich every rollout of ``rollouts`` (any fsspec URL, ``.gz`` too) with its captured calls.

    Output keeps line order and line count; it defaults to ``<input stem>.enriched.jsonl``
    beside the input and appears only once complete. Lines that are not rollout records
    pass through unchanged and are reported (``strict`` fails instead).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1; got {batch_size}")
    check_inputs(capture_dir, storage_options)
    target = output or default_output(rollouts)
    started = time.perf_counter()
    done = enrich_to_spool(
        rollouts,
        capture_dir,
        target,
        include_payloads=include_payloads,
        quiescence_timeout_s=quiescence_timeout_s,
        batch_size=batch_size,
        max_workers=max_workers,
        runner=runner,
        dask_address=dask_address,
        strict=strict,
        storage_options=storage_options,
        credentials_block=credentials_block,
    )
    try:
        write_enriched(done.spool.path, target, done.spool.lines, storage_options, credentials_block)
    except BaseException:
        done.spool.discard()
        raise
    summary = EnrichSummary(
        source=rollouts,
        output=target,
        batches=done.batches,
        seconds=round(time.perf_counter() - started, 3),
        stats=done.stats,
    )
    report_enrichment(summary)
    return summary
