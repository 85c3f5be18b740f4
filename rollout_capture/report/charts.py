"""The report's SVG charts, drawn here as strings (no script, no font, no image): a sketch's
histogram with its percentiles marked, horizontal bars, stacked bars."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape
from typing import Any

from rollout_capture.report.formatting import DASH, fmt_count, fmt_int, percentile_marks, tooltip
from rollout_capture.summary import NO_STATUS, Histogram, Sketch, shorten

WIDTH = 540
"""Chart width in SVG units (the page lays two charts a row)."""
GOOD, WARN, BAD, NEUTRAL = "#2f9e62", "#e0a030", "#d64545", "#8a94a6"
BLUE, TEAL, ORANGE = "#3b6fd4", "#27a3a3", "#e07b39"
STATUS_COLORS = {"1xx": NEUTRAL, "2xx": GOOD, "3xx": NEUTRAL, "4xx": WARN, "5xx": BAD, NO_STATUS: "#8b3a3a"}
_LEFT, _RIGHT, _TOP, _BOTTOM = 46, 26, 40, 40
"""A histogram's margins around its plot: y labels, the right edge, the percentile legend, x labels."""


def _nice_step(top: float, ticks: int = 4) -> float:
    """A round step (1, 2 or 5 x 10^k) giving about ``ticks`` gridlines up to ``top``."""
    if top <= 0:
        return 1.0
    raw = top / ticks
    power = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 5, 10):
        if raw <= factor * power:
            return float(max(1, factor * power))
    return float(10 * power)


def _empty_svg(message: str, height: int = 120) -> str:
    return (
        f'<svg viewBox="0 0 {WIDTH} {height}" role="img" aria-label="{escape(message)}">'
        f'<text class="empty" x="{WIDTH / 2}" y="{height / 2}" text-anchor="middle">'
        f"{escape(message)}</text></svg>"
    )


@dataclass(slots=True)
class _Frame:
    """Where a histogram's plot sits in its SVG and its y scale: what each part of it draws by."""

    hist: Histogram
    height: int
    plot_w: int
    plot_h: int
    zero_slot: int  # 1 when values <= 0 have a bar of their own, left of the bins
    slot_w: float
    step: float
    y_top: float

    @property
    def axis_y(self) -> int:
        return _TOP + self.plot_h


def _frame(hist: Histogram, height: int) -> _Frame:
    plot_w, plot_h = WIDTH - _LEFT - _RIGHT, height - _TOP - _BOTTOM
    zero_slot = 1 if hist.zeros else 0
    slots = len(hist.counts) + zero_slot
    peak = max([hist.zeros, *hist.counts, 1])
    step = _nice_step(peak)
    return _Frame(
        hist, height, plot_w, plot_h, zero_slot, plot_w / max(slots, 1), step, step * math.ceil(peak / step)
    )


def histogram_svg(
    sketch: Sketch, *, label: str, fmt: Any, color: str = BLUE, bins: int = 24, height: int = 230
) -> str:
    """A histogram of a sketch, with p50/p90/p99 marked; log x axis when values span 10x."""
    marks = percentile_marks(sketch)
    hist: Histogram = sketch.histogram(bins)
    if not sketch.count:
        return _empty_svg(f"no {label} recorded")
    frame = _frame(hist, height)
    parts = [f'<svg viewBox="0 0 {WIDTH} {height}" role="img" aria-label="{escape(label)} histogram">']
    _y_grid(frame, parts)
    _histogram_bars(frame, parts, fmt, color)
    _x_labels(frame, parts, fmt)
    axis_y = frame.axis_y
    parts.append(f'<line class="axis" x1="{_LEFT}" x2="{WIDTH - _RIGHT}" y1="{axis_y}" y2="{axis_y}"/>')
    scale_note = "log scale" if hist.log else "linear scale"
    parts.append(
        f'<text x="{_LEFT + frame.plot_w / 2:.1f}" y="{height - 6}" text-anchor="middle">{escape(label)} '
        f"({scale_note})</text>"
    )
    _percentile_lines(frame, parts, marks, fmt)
    parts.append("</svg>")
    return "".join(parts)


def _y_grid(frame: _Frame, parts: list[str]) -> None:
    """Gridlines and their counts, a round step apart."""
    plot_h, y_top = frame.plot_h, frame.y_top
    tick = 0.0
    while tick <= y_top + 1e-9:
        y = _TOP + plot_h - plot_h * tick / y_top
        parts.append(f'<line class="grid" x1="{_LEFT}" x2="{WIDTH - _RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>')
        parts.append(f'<text x="{_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{fmt_count(tick)}</text>')
        tick += frame.step


def _histogram_bars(frame: _Frame, parts: list[str], fmt: Callable[[float], str], color: str) -> None:
    """A bar per non-empty bin, and one for the values <= 0 (labelled 0) when there are any."""
    hist, slot_w = frame.hist, frame.slot_w

    def bar(slot: int, count: int, low: float, high: float, fill: str) -> None:
        h = frame.plot_h * count / frame.y_top
        x = _LEFT + slot * slot_w
        tip = f"{fmt(low)} {DASH} {fmt(high)}: {count:,}" if high > low else f"{fmt(low)}: {count:,}"
        parts.append(
            f'<rect x="{x + 1:.1f}" y="{_TOP + frame.plot_h - h:.1f}" width="{max(slot_w - 2, 1):.1f}" '
            f'height="{h:.1f}" fill="{fill}" rx="2"><title>{escape(tip)}</title></rect>'
        )

    if hist.zeros:
        bar(0, hist.zeros, 0.0, 0.0, NEUTRAL)
        parts.append(
            f'<text x="{_LEFT + slot_w / 2:.1f}" y="{_TOP + frame.plot_h + 16}" text-anchor="middle">0</text>'
        )
    edges = hist.edges
    for i, count in enumerate(hist.counts):
        if count:
            bar(i + frame.zero_slot, count, edges[i], edges[i + 1], color)


def _x_labels(frame: _Frame, parts: list[str], fmt: Callable[[float], str]) -> None:
    """About six bin edges, evenly spread, and always the last."""
    edges, zero_slot, slot_w = frame.hist.edges, frame.zero_slot, frame.slot_w
    if not edges:
        return
    y = _TOP + frame.plot_h + 16
    every = max(1, math.ceil(len(frame.hist.counts) / 6))
    for i in range(0, len(edges), every):
        x = _LEFT + (i + zero_slot) * slot_w
        parts.append(f'<text x="{x:.1f}" y="{y}" text-anchor="middle">{fmt(edges[i])}</text>')
    if (len(edges) - 1) % every:
        x = _LEFT + (len(edges) - 1 + zero_slot) * slot_w
        parts.append(f'<text x="{x:.1f}" y="{y}" text-anchor="middle">{fmt(edges[-1])}</text>')


def _x_of(frame: _Frame, value: float) -> float | None:
    """Where a value falls on the x axis (None: off the chart)."""
    hist, zero_slot, slot_w = frame.hist, frame.zero_slot, frame.slot_w
    if value <= 0:
        return _LEFT + slot_w / 2 if hist.zeros else None
    edges = hist.edges
    if not edges:
        return None
    low, high = edges[0], edges[-1]
    if high <= low:
        return _LEFT + zero_slot * slot_w + (frame.plot_w - zero_slot * slot_w) / 2
    if hist.log:
        position = math.log(max(value, low) / low) / math.log(high / low)
    else:
        position = (value - low) / (high - low)
    return _LEFT + zero_slot * slot_w + min(max(position, 0.0), 1.0) * len(hist.counts) * slot_w


def _percentile_lines(
    frame: _Frame, parts: list[str], marks: dict[int, float | None], fmt: Callable[[float], str]
) -> None:
    """p50/p90/p99: dashed lines, labelled in a row above the plot (never over the bars)."""
    label_x = float(_LEFT)
    for q, dash in ((50, "none"), (90, "5 3"), (99, "2 2")):
        mark = marks[q]
        mark_x = None if mark is None else _x_of(frame, mark)
        if mark_x is None or mark is None:
            continue
        value = mark
        parts.append(
            f'<line x1="{mark_x:.1f}" x2="{mark_x:.1f}" y1="{_TOP - 4}" y2="{frame.axis_y}" stroke="#1d2433" '
            f'stroke-width="1.3" stroke-dasharray="{dash}"><title>p{q} {escape(fmt(value))}</title></line>'
        )
        text = f"p{q} {fmt(value)}"
        parts.append(
            f'<line x1="{label_x:.1f}" x2="{label_x + 18:.1f}" y1="{_TOP - 22}" y2="{_TOP - 22}" '
            'stroke="#1d2433" '
            f'stroke-width="1.3" stroke-dasharray="{dash}"/>'
            f'<text x="{label_x + 22:.1f}" y="{_TOP - 18}" class="mark">{escape(text)}</text>'
        )
        label_x += 36 + 6.5 * len(text)


def bars_svg(
    items: Sequence[tuple[str, float, str]],
    *,
    empty: str,
    fmt: Any = fmt_int,
    total: float | None = None,
    label_chars: int = 30,
) -> str:
    """Horizontal bars ``(label, value, color)``, largest first as given; shares when ``total``."""
    if not items:
        return _empty_svg(empty, 80)
    row_h, top, label_w, value_w = 26, 8, 200, 110
    height = top * 2 + row_h * len(items)
    plot_w = WIDTH - label_w - value_w
    peak = max(value for _, value, _ in items) or 1
    parts = [f'<svg viewBox="0 0 {WIDTH} {height}" role="img" aria-label="{escape(empty)}">']
    for i, (label, value, color) in enumerate(items):
        y = top + i * row_h
        w = max(plot_w * value / peak, 2 if value else 0)
        share = f" ({value / total:.1%})" if total else ""
        parts.append(
            f'<text x="{label_w - 8}" y="{y + row_h / 2 + 4:.1f}" text-anchor="end">'
            f"<title>{tooltip(label)}</title>{escape(shorten(label, label_chars))}</text>"
        )
        parts.append(
            f'<rect x="{label_w}" y="{y + 4}" width="{w:.1f}" height="{row_h - 8}" fill="{color}" rx="3">'
            f"<title>{tooltip(label)}: {escape(fmt(value))}{share}</title></rect>"
        )
        parts.append(
            f'<text x="{label_w + w + 6:.1f}" y="{y + row_h / 2 + 4:.1f}">{escape(fmt(value))}{share}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def stacked_bars_svg(
    items: Sequence[tuple[str, Sequence[float | None]]],
    series: Sequence[tuple[str, str]],
    *,
    empty: str,
    label_chars: int = 30,
    notes: Sequence[str] = (),
) -> str:
    """Horizontal stacked bars (tokens in / out per model) with a legend; ``notes[i]``, when given,
    is said beside bar ``i`` alone (what its figure leaves out)."""
    if not items:
        return _empty_svg(empty, 80)
    texts = []  # beside each bar: its total, and its note
    for i, (_, values) in enumerate(items):
        known = [value for value in values if value is not None]
        total = fmt_count(sum(known)) if known else "unknown"
        note = notes[i] if i < len(notes) else ""
        texts.append((f"{total} · {note}" if known else note) if note else total)
    row_h, top, label_w = 26, 26, 200
    value_w = max(80, 12 + 6.5 * max(len(text) for text in texts))  # room for the longest, never cut
    height = top + 8 + row_h * len(items)
    plot_w = WIDTH - label_w - value_w
    peak = max(sum(value or 0 for value in values) for _, values in items) or 1
    parts = [f'<svg viewBox="0 0 {WIDTH} {height}" role="img" aria-label="{escape(empty)}">']
    x = label_w
    for name, color in series:
        parts.append(f'<rect x="{x}" y="6" width="10" height="10" fill="{color}" rx="2"/>')
        parts.append(f'<text x="{x + 14}" y="15">{escape(name)}</text>')
        x += 24 + 7 * len(name)
    for i, (label, values) in enumerate(items):
        y = top + i * row_h
        parts.append(
            f'<text x="{label_w - 8}" y="{y + row_h / 2 + 4:.1f}" text-anchor="end">'
            f"<title>{tooltip(label)}</title>{escape(shorten(label, label_chars))}</text>"
        )
        x0 = float(label_w)
        for (name, color), value in zip(series, values, strict=True):
            w = plot_w * (value or 0) / peak
            if w > 0:
                parts.append(
                    f'<rect x="{x0:.1f}" y="{y + 4}" width="{w:.1f}" height="{row_h - 8}" fill="{color}">'
                    f"<title>{tooltip(label)} {escape(name)}: {fmt_int(value)}</title></rect>"
                )
            x0 += w
        parts.append(f'<text x="{x0 + 6:.1f}" y="{y + row_h / 2 + 4:.1f}">{escape(texts[i])}</text>')
    parts.append("</svg>")
    return "".join(parts)
