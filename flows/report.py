"""What a flow run tells the people watching it: progress, a table, a summary.

Artifacts carry counts and line numbers only: no payloads, no storage options (they
could hold endpoints of interest to nobody else), never credentials.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from uuid import UUID

from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.logging.handlers import APILogHandler
from prefect.utilities.slugify import slugify
from pydantic import BaseModel, Field

from rollout_capture.batch import BatchStats

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
    return output if "://" in output else "file://" + os.path.abspath(output)


class EnrichSummary(BaseModel):
    """The outcome of one enrichment: what was read, written and found."""

    source: str
    output: str
    batches: int
    seconds: float
    stats: BatchStats = Field(default_factory=BatchStats)


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
    """The table and markdown artifacts of a finished enrichment."""
    stats = summary.stats
    rows: list[dict[str, str | int]] = [
        {"measure": "lines", "value": stats.lines},
        {"measure": "rollouts enriched", "value": stats.rollouts},
        {"measure": "model calls", "value": stats.calls},
        {"measure": "tokens in", "value": stats.tokens_in},
        {"measure": "tokens out", "value": stats.tokens_out},
        {"measure": "tokens total", "value": stats.tokens_total},
        {"measure": "rollouts waited for", "value": stats.waited_for},
        {"measure": "rollouts with any gap", "value": stats.rollouts_with_gaps},
        {"measure": "unparseable lines", "value": len(stats.problems)},
    ]
    rows.extend({"measure": f"gap: {code}", "value": count} for code, count in stats.gaps.items())
    create_table_artifact(
        table=rows,
        key=artifact_key("enrichment", summary.output),
        description=f"{summary.source} -> {summary.output}",
    )
    create_link_artifact(
        link=_link(summary.output),
        link_text=summary.output,
        key=artifact_key("enriched-output", summary.output),
        description="The enriched rollouts",
    )

    lines = [
        "# Rollout enrichment",
        "",
        f"- input: `{summary.source}`",
        f"- output: `{summary.output}`",
        f"- {stats.rollouts} rollout(s) enriched with {stats.calls} model call(s) "
        f"in {summary.batches} batch(es), {summary.seconds:.1f}s",
        f"- tokens: {stats.tokens_in} in, {stats.tokens_out} out, {stats.tokens_total} total",
        f"- rollouts with any gap: {stats.rollouts_with_gaps} ({100 * stats.gap_share:.1f}%)",
    ]
    if stats.gaps:
        lines += ["", "## Gaps", "", "| code | rollouts |", "| --- | --- |"]
        lines += [f"| `{code}` | {count} |" for code, count in stats.gaps.items()]
    if stats.problems:
        lines += ["", f"## Lines passed through unchanged ({len(stats.problems)})", ""]
        lines += [f"- line {p.line}: {p.reason}" for p in stats.problems[:MAX_LISTED_PROBLEMS]]
        if len(stats.problems) > MAX_LISTED_PROBLEMS:
            lines.append(f"- ... and {len(stats.problems) - MAX_LISTED_PROBLEMS} more")
    create_markdown_artifact(
        markdown="\n".join(lines), key=artifact_key("enrichment-summary", summary.output)
    )
