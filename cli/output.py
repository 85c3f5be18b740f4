"""What a command prints: one JSON summary with ``--json``, text for people otherwise, and every
error as one ``error:`` line and an exit code (2 bad input, 1 the work failed)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import typer
from rich.console import Console
from rich.table import Table


class InputError(Exception):
    """Bad input: exit code 2."""


def _rounded(value: Any, places: int = 3) -> Any:
    """Floats rounded for people (a sum of latencies prints 164.547, not 164.54699999999997)."""
    if isinstance(value, float):
        return round(value, places)
    if isinstance(value, dict):
        return {key: _rounded(item, places) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_rounded(item, places) for item in value]
    return value


def _print_json(value: Any) -> None:
    """One JSON document on stdout, its floats rounded."""
    typer.echo(json.dumps(_rounded(value), indent=2, default=str))


Text = str | Callable[[], None]
"""What a command says to people: a line for stdout, or a function printing its tables and notes."""


@dataclass(frozen=True)
class Output:
    """The one place a command's ``--json`` is looked at: ``result`` prints the summary one way or
    the other, ``exits`` turns errors into a message and an exit code (a JSON one too)."""

    json: bool = False

    def result(
        self, value: Mapping[str, Any] | Callable[[], Mapping[str, Any]], text: Text, *, ok: bool = True
    ) -> None:
        """``{"ok": ok, **value}`` as JSON, or ``text`` (``value`` may be a function: built for JSON only)."""
        if self.json:
            _print_json({"ok": ok, **(value() if callable(value) else value)})
        elif callable(text):
            text()
        else:
            from rollout_capture.printable import printable_lines

            typer.echo(printable_lines(text))  # a run's folder name acts on no terminal

    @contextmanager
    def exits(self) -> Iterator[None]:
        """Turn errors into a one-line message and an exit code, never a bare traceback."""
        from rollout_capture.faults import is_transient_storage_error

        try:
            yield
        except typer.Exit:
            raise
        except (InputError, ValueError, FileNotFoundError, IsADirectoryError, PermissionError) as exc:
            code, message = 2, str(exc)
        except Exception as exc:
            if type(exc).__name__ == "NoCredentialsError":  # botocore's: nothing in the credential chain
                code, message = 2, f"{exc}: set AWS credentials (environment, profile, role) or a block"
            else:
                kind = (
                    "storage fault (after retries)" if is_transient_storage_error(exc) else type(exc).__name__
                )
                code, message = 1, f"{kind}: {exc}"
        else:
            return
        from rollout_capture.printable import printable_lines

        message = printable_lines(message)  # a name from a capture or record acts on no terminal
        typer.echo(f"error: {message}", err=True)
        if self.json:
            _print_json({"ok": False, "exit_code": code, "error": message})
        raise typer.Exit(code) from None


def show(rows: Sequence[Sequence[str]], header: Sequence[str] | None = None) -> None:
    """A table for people (rich, no borders: easy to read and to grep). Every cell is shown as the
    characters it holds: control characters escaped, no rich markup read (a model name from the
    upstream's answer can neither drive the terminal nor style the table)."""
    from rich.text import Text

    from rollout_capture.printable import printable

    table = Table(box=None, show_header=header is not None, pad_edge=False)
    for name in header or ("",) * len(rows[0]):
        table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(*(Text(printable(cell)) for cell in row))
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def num(value: Any) -> str:
    """A figure for a table: ``-`` when absent, floats to one place."""
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def counts(by_key: dict[str, int]) -> str:
    """``key n, key n`` (``-`` for none)."""
    return ", ".join(f"{key} {n}" for key, n in by_key.items()) or "-"


def percentiles(values: dict[str, int | None], unit: str = "") -> str:
    """``p50 / p90 / p99 unit``, or ``unknown`` when none was recorded."""
    if all(value is None for value in values.values()):
        return "unknown"
    return " / ".join(num(values[key]) for key in values) + (f" {unit}" if unit else "")
