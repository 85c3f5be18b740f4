"""What a flow run tells the people watching it: progress, a table, a summary.

Artifacts carry counts and line numbers only: no payloads, no storage options (they
could hold endpoints of interest to nobody else), never credentials.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from uuid import UUID

from prefect import get_run_logger
from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactUpdate
from prefect.client.schemas.objects import State
from prefect.logging.handlers import APILogHandler
from prefect.states import Completed
from prefect.utilities.slugify import slugify
from prefect.utilities.urls import url_for
from pydantic import BaseModel, Field

from rollout_capture.batch import BatchStats
from rollout_capture.filesystem import absolute_location, is_local, local_path, open_filesystem
from rollout_capture.following import FollowProgress
from rollout_capture.location import Location
from rollout_capture.report import default_report_path, render_report, write_report
from rollout_capture.rollout_files import refuse_unsafe_output
from rollout_capture.tasks.credentials import credentials_from_block

MAX_LISTED_PROBLEMS = 50
CORE_LOGGER = "rollout_capture"
_MAX_KEY = 100


def show_core_logs() -> None:
    """Send the core's log records (e.g. "could not read captures") to the flow run's logs in the UI.

    Prefect forwards only its own loggers and those named in ``PREFECT_LOGGING_EXTRA_LOGGERS``
    when it sets logging up; this covers every way a flow is started, once per process.
    """
    logger = logging.getLogger(CORE_LOGGER)
    if not any(isinstance(handler, APILogHandler) for handler in logger.handlers):
        logger.addHandler(APILogHandler())
    from rollout_capture.flows.console import escape_console_logs

    escape_console_logs()  # a worker's or serve's terminal shows the flow's logs too


def artifact_key(kind: str, output: str) -> str:
    """A key of its own for each enrichment target, so one run's history never mixes with another's.

    Keys allow lowercase letters, digits and dashes; long targets keep a hash to stay apart.
    """
    slug = slugify(output)
    if len(slug) > _MAX_KEY - len(kind) - 1:
        digest = hashlib.sha256(output.encode()).hexdigest()[:10]
        slug = f"{slug[-(_MAX_KEY - len(kind) - 12) :].strip('-')}-{digest}"
    return f"{kind}-{slug}"


def _link(output: str) -> str:
    local = local_path(output)
    return output if local is None else "file://" + os.path.abspath(local)


class EnrichSummary(BaseModel):
    """The outcome of one enrichment: what was read, written and found."""

    source: str
    output: str
    batches: int
    seconds: float
    stats: BatchStats = Field(default_factory=BatchStats)
    report: str | None = None
    """The HTML evidence report written beside the output (None: it could not be written)."""
    traces: str | None = None
    """What the trace export sent, or why it failed (None: no ``otlp_endpoint`` was given)."""


ProgressListener = Callable[[str, int, int], None]
"""Told ``(source, bytes done, bytes in all)`` as an enrichment advances (a terminal's progress bar)."""
_listeners: list[ProgressListener] = []


@contextmanager
def listening_to_progress(listener: ProgressListener) -> Iterator[None]:
    """Tell ``listener`` about the progress of every enrichment this process runs meanwhile."""
    _listeners.append(listener)
    try:
        yield
    finally:
        _listeners.remove(listener)


def start_progress(source: str, size: int) -> UUID:
    """A progress artifact that advances per batch (by bytes read: no pass to count lines)."""
    artifact_id = create_progress_artifact(progress=0.0, description=f"Enriching {source} ({size:,} bytes)")
    assert isinstance(artifact_id, UUID)  # the sync variant, as this runs in a sync flow
    for listener in list(_listeners):
        listener(source, 0, size)
    return artifact_id


def advance_progress(artifact_id: UUID, source: str, done: int, total: int) -> None:
    """Move the artifact (and any terminal listening) to ``done`` of ``total`` bytes."""
    update_progress_artifact(artifact_id=artifact_id, progress=100.0 * done / max(total, 1))
    for listener in list(_listeners):
        listener(source, done, total)


def publish_summary(summary: EnrichSummary) -> None:
    """The table, markdown and link artifacts of a finished enrichment (output and report)."""
    where = absolute_location(summary.output)  # keys of one target alike from whichever folder
    create_table_artifact(
        table=_summary_rows(summary),
        key=artifact_key("enrichment", where),
        description=f"{summary.source} -> {summary.output}",
    )
    create_link_artifact(
        link=_link(summary.output),
        link_text=summary.output,
        key=artifact_key("enriched-output", where),
        description="The enriched rollouts",
    )
    if summary.report is not None:
        create_link_artifact(
            link=_link(summary.report),
            link_text=summary.report,
            key=artifact_key("evidence-report", where),
            description="The evidence report (one HTML file: latency, TTFT, tokens, failed calls, gaps)",
        )
    create_markdown_artifact(
        markdown=_summary_markdown(summary), key=artifact_key("enrichment-summary", where)
    )


def _summary_rows(summary: EnrichSummary) -> list[dict[str, str | int | float]]:
    """The enrichment table: the counts, each gap code, then the evidence's rows (less its totals)."""
    stats = summary.stats
    evidence = stats.evidence
    rows: list[dict[str, str | int | float]] = [
        {"measure": "lines", "value": stats.lines},
        {"measure": "rollouts enriched", "value": stats.rollouts},
        {"measure": "model calls", "value": stats.calls},
        {"measure": "failed calls", "value": evidence.failed_calls},
        {"measure": "tokens in", "value": _cell(evidence.tokens_in)},
        {"measure": "tokens out", "value": _cell(evidence.tokens_out)},
        {"measure": "tokens total", "value": _cell(evidence.tokens_total)},
        {"measure": "calls without tokens total", "value": evidence.tokens_total_unknown_calls},
        {"measure": "rollouts waited for", "value": stats.waited_for},
        {"measure": "rollouts with any gap", "value": stats.rollouts_with_gaps},
        {"measure": "unparseable lines", "value": len(stats.problems)},
    ]
    rows.extend({"measure": f"gap: {code}", "value": count} for code, count in stats.gaps.items())
    rows.extend(
        {"measure": f"{row['section']}: {row['name']}", "value": _cell(row["value"])}
        for row in evidence.to_rows()
        if row["section"] != "totals"
    )
    return rows


def _summary_markdown(summary: EnrichSummary) -> str:
    """The enrichment's markdown summary: input, output, counts, the evidence, the lines passed through."""
    stats = summary.stats
    evidence = stats.evidence
    lines = [
        "# Rollout enrichment",
        "",
        f"- input: `{summary.source}`",
        f"- output: `{summary.output}`",
        f"- {stats.rollouts} rollout(s) enriched with {stats.calls} model call(s) "
        f"in {summary.batches} batch(es), {summary.seconds:.1f}s",
        f"- failed calls: {evidence.failed_calls} ({100 * evidence.failed_share:.1f}%)",
        f"- tokens in / out / total: {evidence.tokens_line()}",
        f"- capture hold p50 / p99: {evidence.capture_hold_ms.p50_p99('ms')}",
        f"- rollouts with any gap: {stats.rollouts_with_gaps} ({100 * stats.gap_share:.1f}%)",
    ]
    if summary.report is not None:
        lines.append(f"- evidence report: [{summary.report}]({_link(summary.report)})")
    if summary.traces is not None:
        lines.append(f"- traces: {summary.traces}")
    lines += ["", "## Evidence", "", evidence.to_markdown()]
    if stats.problems:
        lines += ["", f"## Lines passed through unchanged ({len(stats.problems)})", ""]
        lines += [f"- line {p.line}: {p.reason}" for p in stats.problems[:MAX_LISTED_PROBLEMS]]
        if len(stats.problems) > MAX_LISTED_PROBLEMS:
            lines.append(f"- ... and {len(stats.problems) - MAX_LISTED_PROBLEMS} more")
    return "\n".join(lines)


def _cell(value: object) -> str | int | float:
    return value if isinstance(value, str | int | float) else "unknown" if value is None else str(value)


def write_evidence_report(summary: EnrichSummary, output: Location) -> str:
    """Write the HTML report beside the output (``x.jsonl`` -> ``x.report.html``); returns where.

    Drawn from the summed batch summaries, so the output is not read again. A local report
    is written whole (renamed over) and never through a link; on an object store it is one
    object, written through the output's filesystem with the run's credentials.
    """
    where = output.at(default_report_path(summary.output))
    title = summary.source.rstrip("/").rsplit("/", 1)[-1] or summary.source
    credentials = credentials_from_block(where.credentials_block)
    fs, path = open_filesystem(where.url, where.storage_options, credentials=credentials)
    if is_local(fs):
        refuse_unsafe_output(where.url, where.storage_options)
        write_report(summary.stats.evidence, path, title=title)
    else:
        html = render_report(
            summary.stats.evidence, title=title, unreadable_lines=len(summary.stats.problems)
        )
        fs.pipe_file(path, html.encode("utf-8"))
    return where.url


def shares_exceeded(
    stats: BatchStats, max_gap_share: float | None, max_failed_share: float | None
) -> tuple[bool, bool]:
    """Whether the gap share and the failed-call share are past their thresholds: strictly
    above, so a share equal to its threshold (``max_gap_share=0`` and a clean run) is not poor.
    The one decision behind the state's name, the reasons, the WARNING and the events."""
    return _exceeded(stats.gap_share, stats.evidence.failed_share, max_gap_share, max_failed_share)


def _exceeded(
    gap_share: float, failed_share: float, max_gap_share: float | None, max_failed_share: float | None
) -> tuple[bool, bool]:
    gaps = max_gap_share is not None and gap_share > max_gap_share
    failed = max_failed_share is not None and failed_share > max_failed_share
    return gaps, failed


def poor_state_name(
    gap_share: float, failed_share: float, max_gap_share: float | None, max_failed_share: float | None
) -> str | None:
    """The named ``Completed`` state these shares earn ("Completed with gaps"), None when not poor:
    :func:`final_state`'s name, from the figures an ``_ENRICHED`` marker keeps."""
    exceeded = _exceeded(gap_share, failed_share, max_gap_share, max_failed_share)
    return POOR_STATE_NAMES.get(exceeded)


def poor_evidence(
    stats: BatchStats, max_gap_share: float | None, max_failed_share: float | None
) -> list[str]:
    """Why an enrichment's evidence is poor (shares past their thresholds); empty when it is not."""
    gaps, failed = shares_exceeded(stats, max_gap_share, max_failed_share)
    reasons = []
    if gaps:
        reasons.append(
            f"{stats.rollouts_with_gaps} of {stats.rollouts} rollouts have gaps "
            f"({stats.gap_share:.1%} > {max_gap_share:.1%})"
        )
    evidence = stats.evidence
    if failed:
        reasons.append(
            f"{evidence.failed_calls} of {evidence.calls} calls failed "
            f"({evidence.failed_share:.1%} > {max_failed_share:.1%})"
        )
    return reasons


POOR_STATE_NAMES = {
    (True, False): "Completed with gaps",
    (False, True): "Completed with failed calls",
    (True, True): "Completed with gaps and failed calls",
}


def final_state(
    summary: EnrichSummary, max_gap_share: float | None, max_failed_share: float | None
) -> State[EnrichSummary] | EnrichSummary:
    """The flow's return: the summary itself, or a ``Completed`` state named after what is poor.

    The run still completes (its output is published), but the UI shows "Completed with
    gaps" (or "... failed calls") at a glance, with the reasons as the state's message.
    """
    stats = summary.stats
    gaps, failed = shares_exceeded(stats, max_gap_share, max_failed_share)
    if not (gaps or failed):
        return summary
    message = "; ".join(poor_evidence(stats, max_gap_share, max_failed_share))
    state: State[EnrichSummary] = Completed(
        name=POOR_STATE_NAMES[gaps, failed], message=message, data=summary
    )
    return state


def task_run_link(task_run_id: UUID | None) -> str:
    """Where a task run's page is: the UI's URL when one is known, else its path in the UI."""
    if task_run_id is None:
        return "-"
    return url_for("task-run", obj_id=task_run_id) or f"/runs/task-run/{task_run_id}"


MAX_LISTED_RUNS = 100
"""Runs (and batches) a tick's summary names; each batch's table lists every one of its runs."""
_ROUTINE = {"enriched", "already_enriched"}
Row = dict[str, str | int | float | None]


def _cell_text(value: object, limit: int = 300) -> str:
    """A value as one markdown table cell: no pipes, no line breaks, not too long."""
    text = " ".join(str(value).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def publish_batch_table(label: str, rows: list[Row], headline: str) -> None:
    """A batch of runs' table, filed under its task run: a row per run (status, counts, seconds,
    why it failed). Unkeyed: a tick has a table per batch, each small enough to show at once.
    Its runs are enriched already: an API that refuses the table (a busy server's 503) is logged."""
    try:
        create_table_artifact(table=rows, description=f"{label}: {headline}")
    except Exception as exc:
        get_run_logger().warning("%s: its table artifact was not published: %s", label, exc)


def needs_a_look(row: Row) -> bool:
    """A run the tick's summary names: failed, lost, busy, or enriched with poor evidence."""
    return row["status"] not in _ROUTINE


def publish_tick_summary(key_source: str, headline: str, notable: list[Row], batches: list[Row]) -> None:
    """The scheduled tick's summary (keyed by its root, so ticks make a history): what it did, the
    runs needing a look (failed, lost, busy, poor evidence) and every batch, each with a link to
    its task run, where its table and its logs are."""
    tried = sum(int(batch["runs"] or 0) for batch in batches)
    lines = [
        f"# Runs under `{key_source}`",
        "",
        f"{tried} run(s) tried in {len(batches)} batch(es): {headline}.",
    ]
    if notable:
        lines += [
            "",
            f"## Runs needing a look ({len(notable)})",
            "",
            "| run | status | rollouts | calls | gap share | failed calls | batch | error |",
            "| --- | --- | ---: | ---: | ---: | ---: | --- | --- |",
        ]
        columns = ("status", "rollouts", "calls", "gap_share", "failed_calls")
        lines += [
            f"| {_cell_text(row['run'])} | {' | '.join(_figure(row[c]) for c in columns)} "
            f"| {_linked('logs', row['batch'])} | {_cell_text(row['error'] or '')} |"
            for row in notable[:MAX_LISTED_RUNS]
        ]
        if len(notable) > MAX_LISTED_RUNS:
            lines.append(f"\n... and {len(notable) - MAX_LISTED_RUNS} more (in their batches' tables)")
    if batches:
        lines += [
            "",
            f"## Batches ({len(batches)})",
            "",
            "| batch | runs | enriched | needing a look | table and logs |",
            "| --- | ---: | ---: | ---: | --- |",
        ]
        lines += [
            f"| {_cell_text(row['batch'])} | {row['runs']} | {row['enriched']} | {row['notable']} "
            f"| {_linked('task run', row['link'])} |"
            for row in batches[:MAX_LISTED_RUNS]
        ]
        if len(batches) > MAX_LISTED_RUNS:
            lines.append(f"\n... and {len(batches) - MAX_LISTED_RUNS} more batches")
    create_markdown_artifact(
        markdown="\n".join(lines) + "\n",
        key=artifact_key("enriched-runs", key_source),
        description=f"Runs under {key_source}: {headline}",
    )


def _figure(value: object) -> str:
    return "-" if value is None else str(value)


def _linked(text: str, link: object) -> str:
    return f"[{text}]({link})" if link and link != "-" else "-"


LIVE_UPDATE_S = 2.0
"""How often a followed run's artifacts are updated, at most (two API requests each time)."""


class LiveView:
    """What a followed run's flow run shows while it runs: a progress artifact (lines live of those
    landed) and its evidence so far (a markdown artifact keyed ``following-<run>``: records, calls,
    failed calls, gap share, latency and TTFT p50/p99, tokens, the gaps), both updated in place,
    at most every :data:`LIVE_UPDATE_S`. An API that refuses an update is logged; following goes on."""

    def __init__(self, run: str, live_output: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.run, self.live_output, self.clock = run, live_output, clock
        self._next = 0.0
        progress_id = create_progress_artifact(progress=0.0, description=f"Following {run}")
        evidence_id = create_markdown_artifact(
            markdown=f"# Following `{run}`\n\nNothing has landed yet.\n",
            key=artifact_key("following", absolute_location(run)),
            description=f"{run}: its evidence so far, while it runs",
        )
        assert isinstance(progress_id, UUID) and isinstance(evidence_id, UUID)  # the sync variants
        self.progress_id, self.evidence_id = progress_id, evidence_id

    def update(self, progress: FollowProgress, *, now: bool = False) -> None:
        """Show ``progress``, unless the last update was less than :data:`LIVE_UPDATE_S` ago."""
        moment = self.clock()
        if not now and moment < self._next:
            return
        self._next = moment + LIVE_UPDATE_S
        try:
            share = 100.0 * progress.live / progress.landed if progress.landed else 0.0
            update_progress_artifact(
                artifact_id=self.progress_id, progress=share, description=live_headline(self.run, progress)
            )
            with get_client(sync_client=True) as client:
                client.update_artifact(
                    artifact_id=self.evidence_id,
                    artifact=ArtifactUpdate(data=live_markdown(self.run, self.live_output, progress)),
                )
        except Exception as exc:  # shown progress: the run is followed whatever the API says
            get_run_logger().warning("%s: its live artifacts were not updated: %s", self.run, exc)


def live_headline(run: str, progress: FollowProgress) -> str:
    """One line: how many lines are live of those landed, and what the next one waits on."""
    line = f"Following {run}: {progress.live:,} of {progress.landed:,} line(s) live"
    if progress.waiting_on:
        line += f"; {progress.waiting:,} waiting on the claims of {', '.join(progress.waiting_on[:3])}"
    elif progress.waiting:
        line += f"; {progress.waiting:,} being enriched"
    return line + (" (finished)" if progress.finished else "")


def live_markdown(run: str, live_output: str, progress: FollowProgress) -> str:
    """The evidence so far of a followed run, as its live artifact shows it."""
    stats = progress.stats
    evidence = stats.evidence
    lines = [
        f"# Following `{run}`",
        "",
        f"- {live_headline(run, progress)}",
        f"- live output: `{live_output}`",
        f"- {stats.rollouts:,} rollout(s) with {stats.calls:,} model call(s)",
        f"- failed calls: {evidence.failed_calls:,} ({100 * evidence.failed_share:.1f}%)",
        f"- rollouts with any gap: {stats.rollouts_with_gaps:,} ({100 * stats.gap_share:.1f}%)",
        f"- latency p50 / p99: {evidence.latency_ms.p50_p99('ms')}",
        f"- TTFT p50 / p99: {evidence.ttft_ms.p50_p99('ms')}",
        f"- tokens in / out / total: {evidence.tokens_line()}",
        f"- updated {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
        "",
        "## Evidence so far",
        "",
        evidence.to_markdown(),
    ]
    return "\n".join(lines) + "\n"
