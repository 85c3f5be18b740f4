"""``enrich_completed_runs``: the scheduled job. Every finished, not yet enriched run, once."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger
from pydantic import BaseModel, Field

from flows.enrich import DEFAULT_BATCH_SIZE, enrich_rollouts
from flows.guard import check_inputs, guarded_flow
from flows.runners import Runner
from rollout_capture.quiescence import CAPTURE_DRAIN_TIMEOUT_S
from rollout_capture.run_folders import DEFAULT_LEASE_S
from tasks.run_folders import find_runs, finish_run, take_run


class RunsSummary(BaseModel):
    """Which runs this invocation enriched, skipped or failed on."""

    enriched: list[str] = Field(default_factory=list)
    busy: list[str] = Field(default_factory=list)
    unfinished: list[str] = Field(default_factory=list)
    already_enriched: list[str] = Field(default_factory=list)
    failed: dict[str, str] = Field(default_factory=dict)


class RunsFailed(RuntimeError):
    """Some runs could not be enriched; the others were."""


@guarded_flow(name="enrich_completed_runs")
def enrich_completed_runs(
    runs_root: str,
    capture_dir: str | None = None,
    include_payloads: bool = False,
    quiescence_timeout_s: float = CAPTURE_DRAIN_TIMEOUT_S,
    batch_size: int = DEFAULT_BATCH_SIZE,
    max_workers: int = 8,
    runner: Runner = "threads",
    lease_s: float = DEFAULT_LEASE_S,
    max_gap_share: float | None = None,
    storage_options: dict[str, Any] | None = None,
    credentials_block: str | None = None,
) -> RunsSummary:
    """Enrich each finished run (``_SUCCESS``, no ``_ENRICHED``) under ``runs_root`` in a subflow.

    ``_ENRICHED`` is written last, so the next schedule skips the run; a lease keeps two
    overlapping schedules off the same run. One failing run does not stop the others.
    """
    check_inputs(capture_dir, storage_options)
    logger = get_run_logger()
    summary = RunsSummary()
    for run in find_runs(runs_root, storage_options, credentials_block):
        if run.enriched:
            summary.already_enriched.append(run.name)
            continue
        if not run.finished:
            summary.unfinished.append(run.name)
            continue
        lease = take_run(runs_root, run, lease_s, storage_options, credentials_block)
        if lease is None:
            logger.info("run %s is being enriched by another flow run; skipped", run.name)
            summary.busy.append(run.name)
            continue
        result: dict[str, Any] | None = None
        try:
            enriched = enrich_rollouts.with_options(flow_run_name=f"enrich-{run.name}")(
                rollouts=run.rollouts,
                capture_dir=capture_dir or run.captures,
                output=run.output,
                include_payloads=include_payloads,
                quiescence_timeout_s=quiescence_timeout_s,
                batch_size=batch_size,
                max_workers=max_workers,
                runner=runner,
                max_gap_share=max_gap_share,
                storage_options=storage_options,
                credentials_block=credentials_block,
            )
            result = enriched.model_dump(mode="json", exclude={"stats": {"problems"}})
            result["unparseable_lines"] = [p.line for p in enriched.stats.problems]
            summary.enriched.append(run.name)
        except Exception as exc:
            logger.error("run %s failed: %s", run.name, exc)
            summary.failed[run.name] = f"{type(exc).__name__}: {exc}"
        finally:
            finish_run(runs_root, run, lease, result, storage_options, credentials_block)
    logger.info(
        "enriched %d run(s), %d busy, %d unfinished, %d already enriched, %d failed",
        len(summary.enriched),
        len(summary.busy),
        len(summary.unfinished),
        len(summary.already_enriched),
        len(summary.failed),
    )
    if summary.failed:
        raise RunsFailed(f"{len(summary.failed)} run(s) failed: {summary.failed}")
    return summary
