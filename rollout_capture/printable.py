"""Text from captures and records shown at a terminal: control characters escaped.

A model name comes from the upstream's answer (``response.model``), a gap detail or an error
category from a record: an escape sequence in one (OSC, clear screen, colours) would act on the
terminal it is printed to, and could erase the lines around it. Shown through :func:`printable`,
it reads as the characters it holds (``\\x1b]0;title\\x07``) and does nothing.
"""

from __future__ import annotations

import logging
from typing import Any


def printable(text: Any) -> str:
    """``text`` (made a string) with every character that is not printable escaped as Python
    writes it (``\\n``, ``\\x1b``, ``\\u202e``); printable text, any script, comes back unchanged.

    Example:
        ```python
        printable("gpt\\x1b[2J")  # 'gpt\\\\x1b[2J'
        ```
    """
    shown = text if isinstance(text, str) else str(text)
    if shown.isprintable():
        return shown
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in shown)


def printable_lines(text: Any) -> str:
    """:func:`printable` of each line, the line breaks kept: a message of several lines (an error,
    a log record) still reads as lines, and nothing in any line acts on the terminal."""
    shown = text if isinstance(text, str) else str(text)
    if shown.isprintable():
        return shown
    return "\n".join(printable(line) for line in shown.split("\n"))


def printable_log_message(record: logging.LogRecord) -> str:
    """A log record's message with each argument shown by :func:`printable` (one line: a name from
    a record holding a line break cannot start a forged log line) and the template's own line
    breaks kept (:func:`printable_lines`); an argument whose text is printable is left as it is."""
    args = record.args
    if isinstance(args, tuple) and args:
        shown = tuple(
            arg if isinstance(arg, int | float) or str(arg).isprintable() else printable(arg) for arg in args
        )
        try:
            return printable_lines(str(record.msg) % shown)
        except (TypeError, ValueError):  # a format the escaped text no longer fits (%d of a str)
            pass
    return printable_lines(record.getMessage())
