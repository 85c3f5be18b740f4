"""What a person at a terminal sees while a flow runs: a progress bar per enrichment.

Only on a TTY; redirected output (CI, a pipe) stays plain. Prefect's console handlers
write straight to the terminal, which would tear a live bar, so while the bar is shown
they print through its console instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from rollout_capture.flows.console import prefect_console_handlers
from rollout_capture.flows.report import listening_to_progress
from rollout_capture.printable import printable


@contextmanager
def _prefect_console_through(console: Console) -> Iterator[None]:
    handlers = prefect_console_handlers()
    saved = {handler: handler.console for handler in handlers}
    for handler in handlers:
        handler.console = console
    try:
        yield
    finally:
        for handler, original in saved.items():
            handler.console = original


@contextmanager
def progress_bars(console: Console | None = None) -> Iterator[None]:
    """Show a bar per enrichment (bytes of its input merged) while the block runs, on a TTY only."""
    console = console or Console(stderr=True)
    if not console.is_terminal:
        yield
        return
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )
    tasks: dict[str, TaskID] = {}

    def advance(source: str, done: int, total: int) -> None:
        if source not in tasks:  # labelled by the end of its path: a run folder and its file
            label = printable("/".join(source.rstrip("/").split("/")[-2:]))  # shown, never acted on
            tasks[source] = progress.add_task(escape(label), total=total)
        progress.update(tasks[source], completed=done, total=total)

    with ExitStack() as stack:
        stack.enter_context(progress)
        stack.enter_context(_prefect_console_through(progress.console))
        stack.enter_context(listening_to_progress(advance))
        yield
