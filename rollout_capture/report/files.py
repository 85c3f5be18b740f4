"""The report as a file: where it goes beside an enriched output, and writing it whole."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rollout_capture.report.page import render_report
from rollout_capture.summary import EvidenceSummary, no_attachment_error, summarize_file, summarize_records


def default_report_path(output: str) -> str:
    """Where the report of an enriched output goes: beside it, ``x.jsonl`` -> ``x.report.html``.

    Plain string work, so it serves local paths and object-store URLs alike.
    """
    head, sep, name = output.rpartition("/")
    for suffix in (".jsonl.gz", ".jsonl", ".json"):
        if name.endswith(suffix) and len(name) > len(suffix):
            name = name[: -len(suffix)]
            break
    return f"{head}{sep}{name}.report.html"


def write_report(
    source: str | Path | Iterable[Mapping[str, Any]] | EvidenceSummary,
    out_path: str | Path,
    *,
    title: str | None = None,
) -> EvidenceSummary:
    """Write the HTML report of an enriched JSONL (a path), parsed records, or a summary.

    The file is written whole (a temporary file renamed over it), so a reader never sees
    half a report. Returns the summary it drew. A file in which no line carries an attachment
    raises :class:`~rollout_capture.summary.EvidenceShapeError` naming it (and nothing is
    written): an empty "0 rollouts" page would say nothing was wrong.
    """
    unreadable = 0
    if isinstance(source, EvidenceSummary):
        summary = source
    elif isinstance(source, str | Path):
        summary, unreadable = summarize_file(source)
        if not summary.rollouts:
            raise no_attachment_error(source)
        title = title or Path(source).name
    else:
        summary = summarize_records(source)
    html = render_report(summary, title=title or "enriched rollouts", unreadable_lines=unreadable)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(html)
        os.chmod(temp, 0o644)  # mkstemp makes it private; a report is meant to be shared
        os.replace(temp, out)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return summary
