"""Prefect events about enrichments, so automations can act on what a run found.

Gaps never fail a run (evidence can be poor while the run is fine), so the counts travel
in events instead: ``rollout-capture.enrichment.completed`` / ``.failed`` for every
enrichment, and ``rollout-capture.enrichment.gaps-exceeded`` when the share of rollouts
with a gap passes the run's threshold, ``.failed-calls-exceeded`` when the share of failed
calls passes its own (Prefect triggers match names and labels, not payload numbers, so the
thresholds are judged here). Payloads hold counts, never secrets.
"""

from __future__ import annotations

import threading
from typing import Any

from prefect.events import emit_event

from rollout_capture.batch import BatchStats
from rollout_capture.filesystem import absolute_location
from rollout_capture.flows.report import shares_exceeded
from rollout_capture.run_events import RUN_FINISHED as RUN_FINISHED
from rollout_capture.run_events import RUN_PREFIX as RUN_PREFIX
from rollout_capture.run_events import RUN_STARTED as RUN_STARTED
from rollout_capture.run_events import run_resource as run_resource
from rollout_capture.run_events import runs_under as runs_under
from rollout_capture.secret_options import shown_url

COMPLETED = "rollout-capture.enrichment.completed"
FAILED = "rollout-capture.enrichment.failed"
GAPS_EXCEEDED = "rollout-capture.enrichment.gaps-exceeded"
FAILED_CALLS_EXCEEDED = "rollout-capture.enrichment.failed-calls-exceeded"
RESOURCE_PREFIX = "rollout-capture.enrichment."


def mark_run_finished(
    run: str, *, storage_options: dict[str, Any] | None = None, credentials_block: str | None = None
) -> str:
    """Mark a run finished (its empty ``_SUCCESS``) and emit ``rollout-capture.run.finished`` naming it,
    so a deployment of its runs root enriches it now rather than at the next tick; returns the run.
    A run already enriched is left as it is, and no event is sent (no tick would do anything).

    Example:
        ```python
        mark_run_finished("s3://my-runs/runs/r1", credentials_block="rollout-capture")
        ```
    """
    from rollout_capture.run_folders import finish_run
    from rollout_capture.tasks.credentials import credentials_from_block

    state = finish_run(run, storage_options, credentials=credentials_from_block(credentials_block))
    if not state.enriched and emit_event(RUN_FINISHED, resource=run_resource(state.url)) is not None:
        _sent()  # before the caller (a harness, a command) moves on or exits
    return state.url


def mark_run_started(
    run: str, *, storage_options: dict[str, Any] | None = None, credentials_block: str | None = None
) -> str:
    """Mark a run started (its empty ``_STARTED``, the folder made on a local disk) and emit
    ``rollout-capture.run.started`` naming it, so a deployment of its runs root follows it while it
    runs; returns the run. A run already started, finished or enriched is left as it is, no event sent.

    Example:
        ```python
        mark_run_started("s3://my-runs/runs/r1", credentials_block="rollout-capture")
        ```
    """
    from rollout_capture.run_folders import start_run
    from rollout_capture.tasks.credentials import credentials_from_block

    state = start_run(run, storage_options, credentials=credentials_from_block(credentials_block))
    fresh = not (state.started or state.finished or state.enriched)
    if fresh and emit_event(RUN_STARTED, resource=run_resource(state.url)) is not None:
        _sent()
    return state.url


SEND_WAIT_S = 10.0
"""How long :func:`_sent` waits for the events worker (it sends within a second; a worker that
failed, e.g. a server that went away, has said so in its log and never empties its queue)."""


def _sent() -> None:
    """Wait until the events emitted so far are sent, then stop the events worker.

    Stopped with an event still queued, Prefect's worker sends it but warns "Still processing
    items" on the way: waiting for an empty queue first keeps a clean exit quiet.
    """
    from prefect.events.worker import EventsWorker

    waiting = threading.Thread(target=EventsWorker.instance().wait_until_empty, daemon=True)
    waiting.start()
    waiting.join(SEND_WAIT_S)
    EventsWorker.drain_all(at_exit=False)


def resource(source: str, output: str) -> dict[str, str]:
    """The enrichment as an event resource: named after its output, labelled with its input.

    Local paths are made absolute: a relative one would name different files from different folders.
    """
    source, output = shown_url(absolute_location(source)), shown_url(absolute_location(output))
    return {
        "prefect.resource.id": RESOURCE_PREFIX + output,
        "prefect.resource.name": output,
        "rollout-capture.source": source,
        "rollout-capture.output": output,
    }


def counts(stats: BatchStats, batches: int, seconds: float) -> dict[str, Any]:
    """What an enrichment found, as numbers."""
    return {
        "lines": stats.lines,
        "rollouts": stats.rollouts,
        "calls": stats.calls,
        "tokens_in": stats.tokens_in,
        "tokens_out": stats.tokens_out,
        "tokens_total": stats.tokens_total,
        "rollouts_with_gaps": stats.rollouts_with_gaps,
        "gap_share": round(stats.gap_share, 6),
        "gaps": dict(stats.gaps),
        "lines_passed_through": len(stats.problems),
        "rollouts_waited_for": stats.waited_for,
        "batches": batches,
        "seconds": seconds,
        **stats.evidence.digest(),
    }


def emit_completed(
    source: str,
    output: str,
    stats: BatchStats,
    batches: int,
    seconds: float,
    max_gap_share: float | None,
    max_failed_share: float | None = None,
) -> None:
    """``completed`` for every enrichment; ``gaps-exceeded`` / ``failed-calls-exceeded`` too when
    the gap share / failed-call share passes its threshold."""
    payload = counts(stats, batches, seconds)
    emit_event(COMPLETED, resource=resource(source, output), payload=payload)
    gaps, failed = shares_exceeded(stats, max_gap_share, max_failed_share)
    if gaps:
        emit_event(
            GAPS_EXCEEDED,
            resource=resource(source, output),
            payload={**payload, "max_gap_share": max_gap_share},
        )
    if failed:
        emit_event(
            FAILED_CALLS_EXCEEDED,
            resource=resource(source, output),
            payload={**payload, "max_failed_share": max_failed_share},
        )


LIVE_MIN_ROLLOUTS = 20
"""Rollouts live before a followed run's shares are judged mid-run: one gap among the first three
rollouts is no share worth waking anyone for."""


class LiveThresholds:
    """A followed run's ``gaps-exceeded`` and ``failed-calls-exceeded``, mid-run: each sent when its
    share crosses its threshold on the way up (and again should it fall back under and cross again),
    once :data:`LIVE_MIN_ROLLOUTS` are live, so an automation hears an hour into a ten-hour run, not
    at its end. Their payload is the evidence so far, ``"live": true``; the end's events follow as
    after any enrichment."""

    def __init__(self, source: str, output: str, max_gap_share: float | None, max_failed_share: float | None):
        self.source, self.output = source, output
        self.max_gap_share, self.max_failed_share = max_gap_share, max_failed_share
        self._above = (False, False)
        self.sent: list[str] = []

    def check(self, stats: BatchStats, seconds: float) -> None:
        """Send what this evidence so far newly crosses."""
        if stats.rollouts < LIVE_MIN_ROLLOUTS:
            return
        gaps, failed = shares_exceeded(stats, self.max_gap_share, self.max_failed_share)
        crossed: list[tuple[str, dict[str, Any]]] = []
        if gaps and not self._above[0]:
            crossed.append((GAPS_EXCEEDED, {"max_gap_share": self.max_gap_share}))
        if failed and not self._above[1]:
            crossed.append((FAILED_CALLS_EXCEEDED, {"max_failed_share": self.max_failed_share}))
        self._above = (gaps, failed)
        if not crossed:
            return
        payload = {**counts(stats, 0, seconds), "live": True}
        for name, extra in crossed:
            emit_event(name, resource=resource(self.source, self.output), payload={**payload, **extra})
            self.sent.append(name)


def emit_failed(source: str, output: str, error: BaseException) -> None:
    """``failed``, with the kind of error and its message (which names inputs, never credentials)."""
    emit_event(
        FAILED,
        resource=resource(source, output),
        payload={"error": type(error).__name__, "message": str(error)[:2000]},
    )
