"""Figures and names as the report shows them: one formatter per kind of value, so a card,
a table and a chart never show one value two ways, and every name escaped and shortened."""

from __future__ import annotations

from collections.abc import Iterable
from html import escape

from rollout_capture.summary import PERCENTILES, Sketch, shorten, unknown_calls_note

DASH = "\u2013"
"""Shown for an unknown value, and between a bin's edges."""
NAME_CHARS = 60
"""A name (model, gap code, category, rollout id) is shown cut to this many characters..."""
TIP_CHARS = 300
"""... and in full up to this many in its tooltip: a 2 MB model name never makes a 12 MB page."""


def fmt_int(value: int | float | None) -> str:
    """``1,234,567``; a dash for unknown."""
    return DASH if value is None else f"{round(value):,}"


def fmt_ms(value: float | None) -> str:
    """A duration in ms as a person reads it: ``850 ms``, ``1.24 s``, ``3.5 min``."""
    if value is None:
        return DASH
    if value < 10:
        return f"{value:.2g} ms"
    if value < 1000:
        return f"{value:.0f} ms"
    if value < 60_000:
        return f"{value / 1000:.3g} s"
    return f"{value / 60_000:.3g} min"


def fmt_count(value: float | None) -> str:
    """A compact count: ``850``, ``12.3k``, ``4.8M``."""
    if value is None:
        return DASH
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}" if value != int(value) else str(int(value))


def plural(n: int, noun: str) -> str:
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def fmt_share(part: int, whole: int) -> str:
    return f"{part / whole:.1%}" if whole else "0.0%"


def tooltip(text: str) -> str:
    """A name for a tooltip: whole up to :data:`TIP_CHARS`, escaped."""
    return escape(shorten(text, TIP_CHARS))


def name_html(text: str, limit: int = NAME_CHARS, tag: str = "code") -> str:
    """A name as the page shows it: cut to ``limit``, the (capped) full text in ``title=``."""
    shown = escape(shorten(text, limit))
    if len(text) <= limit:
        return f"<{tag}>{shown}</{tag}>"
    return f'<{tag} title="{tooltip(text)}">{shown}</{tag}>'


def names_cell(names: Iterable[str]) -> tuple[str, str]:
    """A table cell of rollout ids (each shortened)."""
    return ", ".join(name_html(name) for name in names), "ids"


def percentile_marks(sketch: Sketch) -> dict[int, float | None]:
    """p50/p90/p99 as every part of the page shows them (cards, tables, chart legends): one
    value each, formatted by one formatter, so the card and the chart never disagree."""
    return {q: sketch.percentile(q) for q in PERCENTILES}


def tokens_cell(total: int | None, unknown_calls: int) -> str:
    """A token sum in a table: ``unknown`` when no call reported it, else the sum and the
    calls it leaves out."""
    return "unknown" if total is None else f"{total:,}{unknown_calls_note(unknown_calls)}"
