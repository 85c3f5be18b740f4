"""``report`` and ``export``: an enriched file (on disk or at a URL) as an HTML page or Parquet tables."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import typer

from rollout_capture.cli.options import JsonOpt, Storage, storage_options
from rollout_capture.cli.output import InputError, Output
from rollout_capture.cli.prefect_env import check_file, credentials
from rollout_capture.filesystem import local_path


@contextmanager
def _local_input(path: str, what: str, storage: Storage) -> Iterator[str]:
    """A local, regular file: a path as it is, a URL (an S3 run's output) copied to a temporary one."""
    local = local_path(path)
    if local is not None:
        if not os.path.exists(local):
            raise InputError(f"{what} not found: {local}")
        if not os.path.isfile(local):
            raise InputError(f"{what} is not a regular file: {local}")
        yield local
        return
    import tempfile

    from rollout_capture.filesystem import open_filesystem

    where = storage.at(path)
    resolved = credentials(where.credentials_block, prefect=True)
    check_file(where, resolved, what)
    fs, remote = open_filesystem(where.url, where.storage_options, credentials=resolved)
    with tempfile.TemporaryDirectory(prefix="rollout-capture-") as folder:
        copy = os.path.join(folder, remote.rstrip("/").rsplit("/", 1)[-1])
        fs.get_file(remote, copy)
        try:
            yield copy
        except Exception as exc:
            renamed = _naming(exc, copy, where.url)
            if renamed is None:
                raise
            raise renamed.with_traceback(exc.__traceback__) from None


def _naming(exc: Exception, copy: str, url: str) -> Exception | None:
    """``exc`` (of the same type) naming ``url`` where it names the temporary ``copy`` of it,
    so an error says which file the user gave; None when it does not name the copy."""
    if isinstance(exc, OSError):
        if exc.filename != copy:
            return None
        exc.filename = url
        return exc
    text = str(exc)
    if copy not in text:
        return None
    try:
        return type(exc)(text.replace(copy, url))
    except Exception:  # a type not built from one message: left as it was
        return None


@storage_options(captures=False)
def report(
    storage: Storage,
    enriched: Annotated[str, typer.Argument(help="Enriched rollouts JSONL: a path or fsspec URL.")],
    output: Annotated[
        str | None,
        typer.Option(
            "--output",
            "-o",
            help="Where the HTML goes; default <stem>.report.html beside it (here, for a URL).",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Write one self-contained HTML report of an enriched file: latency, TTFT, tokens, failed calls, gaps.

    The file has no script and loads nothing: open it offline, attach it, archive it.
    """
    out = Output(json=as_json)
    with out.exits():
        from rollout_capture.report import default_report_path, write_report
        from rollout_capture.summary import tokens_text

        with _local_input(enriched, "enriched file", storage) as path:
            beside = default_report_path(path)
            target = output or (beside if path == local_path(enriched) else os.path.basename(beside))
            summary = write_report(path, target)
        out.result(
            lambda: {"report": target, "rollouts": summary.rollouts, **summary.digest()},
            text=f"wrote {target}: {summary.rollouts} rollout(s), {summary.calls} call(s), "
            f"{summary.failed_calls} failed, {summary.rollouts_with_gaps} with gaps, "
            f"{tokens_text(summary.tokens_total, summary.tokens_total_unknown_calls)}",
        )


@storage_options(captures=False)
def export(
    storage: Storage,
    enriched: Annotated[str, typer.Argument(help="Enriched rollouts JSONL: a path or fsspec URL.")],
    calls: Annotated[
        str | None, typer.Option(help="Parquet file of the calls (one row per captured call).")
    ] = None,
    rollouts: Annotated[
        str | None, typer.Option(help="Parquet file of the rollouts (one row per enriched rollout).")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Export an enriched file as Parquet tables of calls and rollouts (needs the export extra).

    Schema: docs/export.md. Each file is written whole or not at all.
    """
    out = Output(json=as_json)
    with out.exits():
        from rollout_capture.export import ExportUnavailable, export_tables

        if calls is None and rollouts is None:
            raise InputError("name --calls, --rollouts or both")
        with _local_input(enriched, "enriched file", storage) as path:
            try:
                counts = export_tables(path, calls, rollouts)
            except ExportUnavailable as exc:
                raise InputError(str(exc)) from None

        def written() -> None:
            for name, where, n in (("call", calls, counts.calls), ("rollout", rollouts, counts.rollouts)):
                if where is not None:
                    typer.echo(f"wrote {where}: {n} {name} row(s)")
            if counts.lines_skipped:
                typer.echo(
                    f"{counts.lines_skipped} line(s) without a capture attachment skipped "
                    "(not JSON and naming none, passed through by enrichment; or records without an id)",
                    err=True,
                )

        out.result(
            {
                "calls_file": calls,
                "rollouts_file": rollouts,
                "calls": counts.calls,
                "rollouts": counts.rollouts,
                "lines_skipped": counts.lines_skipped,
            },
            text=written,
        )
