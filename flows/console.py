"""Prefect's console handlers in this process, and their messages shown escaped.

A flow run's logs reach the terminal of whoever runs it (the command, a worker, ``serve``): a
model name or gap detail from a record in a log line must act on no terminal.
"""

from __future__ import annotations

import logging

from prefect.logging.handlers import PrefectConsoleHandler

from rollout_capture.printable import printable_log_message


def prefect_console_handlers() -> set[PrefectConsoleHandler]:
    """Every handler through which Prefect prints to the terminal, on any logger."""
    return {
        handler
        for name in [None, *logging.root.manager.loggerDict]
        for handler in logging.getLogger(name).handlers
        if isinstance(handler, PrefectConsoleHandler)
    }


class _Printable(logging.Filter):
    """Shows a record's message with its control characters escaped, a line break in an argument
    too (formatted once, here)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        shown = printable_log_message(record)
        if shown != message:
            record.msg, record.args = shown, None
        return True


_PRINTABLE = _Printable()


def escape_console_logs() -> None:
    """Every Prefect console handler of this process escapes control characters (once each)."""
    for handler in prefect_console_handlers():
        if _PRINTABLE not in handler.filters:
            handler.addFilter(_PRINTABLE)
