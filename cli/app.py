"""``rollout-capture``: the flows and the core from a terminal.

Exit codes: 0 done; 1 the work failed (storage faults outlasting retries, rollouts still
claimed after ``wait``); 2 bad input (missing file, malformed line under ``--strict``,
invalid id or option, a capture dir that is not there), always with a message naming the
input. ``--json`` prints one machine-readable summary on stdout instead, failures included.
"""

from __future__ import annotations

import atexit
import gc
import sys
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any

import typer

from rollout_capture.cli.commands import captures, enrich, follow, nemo_gym, operate, outputs, proxy

HELP_MAX_WIDTH = 1000
"""No cap of our own: Click wraps help to the terminal's width (``COLUMNS`` when set), asked as it prints."""


def _plain(text: str | None) -> str | None:
    """Docstring text for ``--help``: reStructuredText's double backticks dropped."""
    return None if text is None else text.replace("``", "")


# Click's plain help, not rich panels: rich cuts option names to fit a narrow terminal
# ("--capture-d…"); Click keeps every name whole and wraps the text beside it.
app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help=_plain(__doc__),
    rich_markup_mode=None,
    context_settings={"max_content_width": HELP_MAX_WIDTH},
)


def _version(show: bool) -> None:
    if show:
        try:
            typer.echo(f"rollout-capture {version('rollout-capture')}")
        except PackageNotFoundError:  # pragma: no cover - run from a plain checkout
            typer.echo("rollout-capture (not installed)")
        raise typer.Exit


@app.callback()
def _main(
    show_version: Annotated[
        bool, typer.Option("--version", is_eager=True, callback=_version, help="Print the version and exit.")
    ] = False,
) -> None:
    """Enrich LLM rollout records with their captured model calls."""


# In the help's order.
app.command()(enrich.enrich)
app.command()(enrich.demo)
app.command()(captures.clear)
app.command()(captures.wait)
app.command("enrich-runs")(enrich.enrich_runs)
app.command()(captures.inspect)
app.command()(captures.compact)
app.command()(outputs.report)
app.command()(outputs.export)
app.command()(proxy.proxy)
app.command("nemo-gym-dir")(nemo_gym.nemo_gym_dir)
app.command()(operate.deploy)
app.command()(operate.serve)
app.command()(operate.start)
app.command()(follow.follow)
app.command()(operate.finish)


def main() -> None:
    """Console entry point."""
    # Registered first, so it runs last at exit (after Prefect's drains): the interpreter's final
    # collection over every object Prefect and pydantic built costs a few tenths of a second;
    # frozen, the memory goes back with the process instead.
    atexit.register(gc.freeze)
    run: Callable[[], Any] = app
    sys.exit(run())
