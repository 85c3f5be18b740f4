"""What a flow run tells the people watching it: progress, a table, a summary.

Artifacts carry counts and line numbers only: no payloads, no storage options (they
could hold endpoints of interest to nobody else), never credentials.
"""

from __future__ import annotations

from uuid import UUID

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from pydantic import BaseModel, Field

from rollout_capture.batch import BatchStats

MAX_LISTED_PROBLEMS = 50


class EnrichSummary(BaseModel):
    """The outcome of one enrichment: what was read, written and found."""

    source: str
    output: str
    batches: int
    seconds: float
    stats: BatchStats = Field(default_factory=BatchStats)


def start_progress(source: str, size: int) -> UUID:
    """A progress artifact that advances per batch (by bytes read: no pass to count lines)."""
    artifact_id = create_progress_artifact(progress=0.0, description=f"Enriching {source} ({size:,} bytes)")
    assert isinstance(artifact_id, UUID)  # the sync variant, as this runs in a sync flow
    return artifact_id


def advance_progress(artifact_id: UUID, done: int, total: int) -> None:
    update_progress_artifact(artifact_id=artifact_id, progress=100.0 * done / max(total, 1))


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
        {"measure": "unparseable lines", "value": len(stats.problems)},
    ]
    rows.extend({"measure": f"gap: {code}", "value": count} for code, count in stats.gaps.items())
    create_table_artifact(
        table=rows, key="rollout-enrichment", description=f"{summary.source} -> {summary.output}"
    )

    lines = [
        "# Rollout enrichment",
        "",
        f"- input: `{summary.source}`",
        f"- output: `{summary.output}`",
        f"- {stats.rollouts} rollout(s) enriched with {stats.calls} model call(s) "
        f"in {summary.batches} batch(es), {summary.seconds:.1f}s",
        f"- tokens: {stats.tokens_in} in, {stats.tokens_out} out, {stats.tokens_total} total",
    ]
    if stats.gaps:
        lines += ["", "## Gaps", "", "| code | rollouts |", "| --- | --- |"]
        lines += [f"| `{code}` | {count} |" for code, count in stats.gaps.items()]
    if stats.problems:
        lines += ["", f"## Lines passed through unchanged ({len(stats.problems)})", ""]
        lines += [f"- line {p.line}: {p.reason}" for p in stats.problems[:MAX_LISTED_PROBLEMS]]
        if len(stats.problems) > MAX_LISTED_PROBLEMS:
            lines.append(f"- ... and {len(stats.problems) - MAX_LISTED_PROBLEMS} more")
    create_markdown_artifact(markdown="\n".join(lines), key="rollout-enrichment-summary")
