"""``clear``, ``wait``, ``inspect`` and ``compact``: one capture root, before dispatch and after."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import typer

from rollout_capture.cli.options import JsonOpt, Storage, storage_options
from rollout_capture.cli.output import Output, num, show
from rollout_capture.cli.prefect_env import credentials, flow_run, preflight, rollouts_and_captures
from rollout_capture.printable import printable


@storage_options()
def clear(
    storage: Storage,
    rollouts: Annotated[str, typer.Argument(help="Rollouts JSONL about to be dispatched.")],
    as_json: JsonOpt = False,
) -> None:
    """Remove the captures of the rollouts about to be dispatched."""
    out = Output(json=as_json)
    with out.exits():
        source, captures = rollouts_and_captures(storage, rollouts)
        from rollout_capture.flows import prepare_dispatch

        cleared = flow_run(
            False,  # quick: no progress to show
            lambda: prepare_dispatch(source.url, captures.url, **captures.flow_parameters()),
        )
        out.result(
            {"capture_dir": captures.url, "rollout_ids_cleared": cleared},
            text=f"cleared captures of {cleared} rollout id(s)",
        )


def _rollout_store(rollout_id: str, storage: Storage) -> Any:
    """``wait`` and ``inspect``: a valid rollout id, and a store whose root is there, read with the
    credentials block's credentials when one is named (Prefect only then: its API holds the block)."""
    from rollout_capture.identity import validate_rollout_id

    validate_rollout_id(rollout_id)
    captures = storage.captures()
    resolved = credentials(captures.credentials_block, prefect=True)  # resolved once a process
    preflight(capture_dirs=storage.must_exist(captures), prefect=False)
    return captures.capture_store(resolved, shared=False)


@storage_options()
def wait(
    storage: Storage,
    rollout_id: Annotated[str, typer.Argument(help="Rollout id, e.g. 12-3 or 12-3-a1.")],
    timeout: Annotated[float, typer.Option(help="Seconds before giving up.")] = 10.0,
    poll: Annotated[float, typer.Option(help="Seconds between checks.")] = 0.05,
    as_json: JsonOpt = False,
) -> None:
    """Wait until no claimed capture write of the rollout is outstanding (exit 1 on timeout)."""
    out = Output(json=as_json)
    with out.exits():
        from rollout_capture import await_model_call_capture_quiescence

        store = _rollout_store(rollout_id, storage)
        quiet = asyncio.run(await_model_call_capture_quiescence(rollout_id, [store], timeout, poll))
        out.result(
            {"rollout_id": rollout_id, "quiescent": quiet, "timeout_s": timeout},
            text=(
                f"{rollout_id}: quiescent"
                if quiet
                else lambda: typer.echo(f"{printable(rollout_id)}: still claimed after {timeout}s", err=True)
            ),
            ok=quiet,
        )
        if not quiet:
            raise typer.Exit(1)


@storage_options()
def inspect(
    storage: Storage,
    rollout_id: Annotated[str, typer.Argument(help="Rollout id, e.g. 12-3.")],
    as_json: JsonOpt = False,
) -> None:
    """Show a rollout's captured calls: tokens, latency, status and gaps."""
    out = Output(json=as_json)
    with out.exits():
        from rollout_capture.attachment import build_attachment
        from rollout_capture.evidence import gather_evidence

        store = _rollout_store(rollout_id, storage)
        attachment = build_attachment(rollout_id, gather_evidence([rollout_id], [store])[rollout_id])
        out.result(attachment, text=lambda: _show_attachment(attachment))


CALL_FIELDS = (
    "model",
    "dialect",
    "status_code",
    "tokens_in",
    "tokens_out",
    "tokens_total",
    "latency_total_ms",
    "error_category",
)


def _show_attachment(attachment: dict[str, Any]) -> None:
    """A row per call and one for the rollout, then its verifier invocations and gaps (a rollout
    with no capture at all: the likely causes)."""
    from rollout_capture.attachment import GAP_NO_RECORDS
    from rollout_capture.faults import NO_CAPTURE_CAUSES

    rows = [
        (str(call["call_index"]), *(num(call[field]) for field in CALL_FIELDS))
        for call in attachment["calls"]
    ]
    metrics = attachment["metrics"]
    totals = (
        num(metrics[field]) for field in ("tokens_in", "tokens_out", "tokens_total", "latency_total_ms")
    )
    rows.append(("all", "", "", "", *totals, ""))
    show(rows, ("#", "model", "dialect", "status", "in", "out", "total", "latency ms", "error"))
    for invocation in attachment.get("verifier_invocations", []):
        typer.echo(
            printable(
                f"verifier {invocation['verifier_invocation_id']}: reward {num(invocation['reward'])}, "
                f"judge calls {invocation['model_call_ids']}"
            )
        )
    for gap in attachment.get("gaps", []):
        typer.echo(printable(f"gap: {gap['code']}" + (f" ({gap['detail']})" if "detail" in gap else "")))
        if gap["code"] == GAP_NO_RECORDS:
            typer.echo(f"  no capture of this rollout: {NO_CAPTURE_CAUSES}")


@storage_options(captures=False)
def compact(
    storage: Storage,
    capture_dir: Annotated[str, typer.Argument(help="Capture root of a finished run: a path or fsspec URL.")],
    quiet: Annotated[
        float | None,
        typer.Option(min=0, help="Seconds its journal must have been quiet (default 120); else refused."),
    ] = None,
    remove_after: Annotated[
        float | None,
        typer.Option(min=0, help="Seconds after the new manifest the replaced commits go (default 30)."),
    ] = None,
    wait_quiet: Annotated[bool, typer.Option(help="Wait out the quiet period instead of refusing.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Compact a finished run's journal into a few large objects (exit 1 if a writer may still write it)."""
    out = Output(json=as_json)
    with out.exits():
        captures = storage.at(capture_dir)
        resolved = credentials(captures.credentials_block, prefect=True)
        preflight(capture_dirs=[captures], prefect=False)
        options: dict[str, Any] = {"wait_quiet": wait_quiet}
        if quiet is not None:
            options["quiet_s"] = quiet
        if remove_after is not None:
            options["remove_after_s"] = remove_after
        done = captures.capture_store(resolved, shared=False).compact(**options)
        refused = done.status == "refused"
        after = done.objects_after if done.objects_after is not None else "?"
        out.result(
            done.as_dict(),
            text=(
                (lambda: typer.echo(printable(f"refused: {done.reason}"), err=True))
                if refused
                else f"{printable(captures.url)}: {done.status} "
                f"({done.objects_before} journal objects before, {after} after)"
            ),
            ok=not refused,
        )
        if refused:
            raise typer.Exit(1)
