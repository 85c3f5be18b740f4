"""One HTML file a person opens: the evidence of an enriched run, charted and tabled.

Everything is inline (CSS and SVG drawn here, no script, no font, no image, no link out),
so the file works offline, from an artifact store or a mail attachment, and opening it
makes no network request. Charts and tables are drawn from an :class:`EvidenceSummary`
alone, so a flow can write the report from the summed batch summaries without reading
its output again. Failed-call and gap shares above 5 % are shown in red.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

from rollout_capture.summary import (
    FAIL_SHARE_WARN,
    MAX_ROWS,
    NO_STATUS,
    PERCENTILES,
    EvidenceSummary,
    Histogram,
    ModelStats,
    Sketch,
    no_attachment_error,
    shorten,
    summarize_file,
    summarize_records,
    tokens_text,
    top_counts,
    unknown_calls_note,
)

DASH = "\u2013"
"""Shown for an unknown value, and between a bin's edges."""
WIDTH = 540
"""Chart width in SVG units (the page lays two charts a row)."""
NAME_CHARS = 60
"""A name (model, gap code, category, rollout id) is shown cut to this many characters..."""
TIP_CHARS = 300
"""... and in full up to this many in its tooltip: a 2 MB model name never makes a 12 MB page."""

GOOD, WARN, BAD, NEUTRAL = "#2f9e62", "#e0a030", "#d64545", "#8a94a6"
BLUE, TEAL, ORANGE = "#3b6fd4", "#27a3a3", "#e07b39"
STATUS_COLORS = {"1xx": NEUTRAL, "2xx": GOOD, "3xx": NEUTRAL, "4xx": WARN, "5xx": BAD, NO_STATUS: "#8b3a3a"}

CSS = """
:root { --fg:#1d2433; --muted:#5b6578; --line:#e3e7ee; --bg:#f5f7fa; --card:#fff;
  --bad:#d64545; --good:#2f9e62; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--fg);
  font: 14px/1.45 -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
main { max-width: 1180px; margin: 0 auto; padding: 28px 24px 48px; }
header h1 { font-size: 22px; margin: 0 0 4px; font-weight: 650; }
header .sub { color: var(--muted); margin: 0 0 20px; word-break: break-all; }
.kpis { display:grid; grid-template-columns: repeat(auto-fill, minmax(112px, 1fr)); gap:12px;
  margin-bottom: 22px; }
.kpi { background:var(--card); border:1px solid var(--line); border-radius:10px; padding:12px 14px; }
.kpi .label { color:var(--muted); font-size:12px; text-transform:uppercase; letter-spacing:.04em; }
.kpi .value { font-size:24px; font-weight:650; margin-top:2px; font-variant-numeric: tabular-nums; }
.kpi .note { color:var(--muted); font-size:12px; }
.kpi.bad { border-color:#f0b4b4; background:#fff5f5; }
.kpi.bad .value, .kpi.bad .note { color:var(--bad); }
.kpi.good .value { color:var(--good); }
h2 { font-size:16px; margin: 26px 0 10px; font-weight:650; }
.grid { display:grid; grid-template-columns: repeat(auto-fit, minmax(520px, 1fr)); gap:14px; }
.card { background:var(--card); border:1px solid var(--line); border-radius:10px; padding:14px 16px; }
.card h3 { font-size:13px; margin:0 0 6px; font-weight:600; }
.card .hint { color:var(--muted); font-size:12px; margin:0 0 6px; }
svg { display:block; width:100%; height:auto; }
svg text { font-family: inherit; fill: #4a5468; font-size: 11px; }
svg .axis { stroke:#c5ccd8; } svg .grid { stroke:#eef1f5; }
svg .empty { font-size: 13px; fill: #9aa3b2; }
svg text.mark { fill:#1d2433; font-weight:600; }
.card.wide { grid-column: 1 / -1; }
table { border-collapse: collapse; width:100%; font-variant-numeric: tabular-nums; }
th, td { text-align:left; padding:6px 10px; border-bottom:1px solid var(--line); vertical-align: top; }
th { color:var(--muted); font-weight:600; font-size:12px; text-transform:uppercase; letter-spacing:.03em; }
td.n, th.n { text-align:right; }
td.bad { color:var(--bad); font-weight:600; }
code { font: 12px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; background:#f0f2f6;
  padding:1px 4px; border-radius:4px; word-break: break-all; }
footer { color:var(--muted); font-size:12px; margin-top:30px; }
"""


# ---------------------------------------------------------------------- formatting


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


def _plural(n: int, noun: str) -> str:
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def fmt_share(part: int, whole: int) -> str:
    return f"{part / whole:.1%}" if whole else "0.0%"


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


def _tip(text: str) -> str:
    """A name for a tooltip: whole up to :data:`TIP_CHARS`, escaped."""
    return escape(shorten(text, TIP_CHARS))


def _name_html(text: str, limit: int = NAME_CHARS, tag: str = "code") -> str:
    """A name as the page shows it: cut to ``limit``, the (capped) full text in ``title=``."""
    shown = escape(shorten(text, limit))
    if len(text) <= limit:
        return f"<{tag}>{shown}</{tag}>"
    return f'<{tag} title="{_tip(text)}">{shown}</{tag}>'


def _names_cell(names: Iterable[str]) -> tuple[str, str]:
    """A table cell of rollout ids (each shortened)."""
    return ", ".join(_name_html(name) for name in names), "ids"


def _percentile_marks(sketch: Sketch) -> dict[int, float | None]:
    """p50/p90/p99 as every part of the page shows them (cards, tables, chart legends): one
    value each, formatted by one formatter, so the card and the chart never disagree."""
    return {q: sketch.percentile(q) for q in PERCENTILES}


def _tokens_cell(total: int | None, unknown_calls: int) -> str:
    """A token sum in a table: ``unknown`` when no call reported it, else the sum and the
    calls it leaves out."""
    return "unknown" if total is None else f"{total:,}{unknown_calls_note(unknown_calls)}"


# ---------------------------------------------------------------------- charts


def _empty_svg(message: str, height: int = 120) -> str:
    return (
        f'<svg viewBox="0 0 {WIDTH} {height}" role="img" aria-label="{escape(message)}">'
        f'<text class="empty" x="{WIDTH / 2}" y="{height / 2}" text-anchor="middle">'
        f"{escape(message)}</text></svg>"
    )


def histogram_svg(
    sketch: Sketch, *, label: str, fmt: Any, color: str = BLUE, bins: int = 24, height: int = 230
) -> str:
    """A histogram of a sketch, with p50/p90/p99 marked; log x axis when values span 10x."""
    marks = _percentile_marks(sketch)
    hist: Histogram = sketch.histogram(bins)
    if not sketch.count:
        return _empty_svg(f"no {label} recorded")
    left, right, top, bottom = 46, 26, 40, 40
    plot_w, plot_h = WIDTH - left - right, height - top - bottom
    zero_slot = 1 if hist.zeros else 0
    slots = len(hist.counts) + zero_slot
    slot_w = plot_w / max(slots, 1)
    peak = max([hist.zeros, *hist.counts, 1])
    step = _nice_step(peak)
    y_top = step * math.ceil(peak / step)
    parts = [f'<svg viewBox="0 0 {WIDTH} {height}" role="img" aria-label="{escape(label)} histogram">']
    tick = 0.0
    while tick <= y_top + 1e-9:
        y = top + plot_h - plot_h * tick / y_top
        parts.append(f'<line class="grid" x1="{left}" x2="{WIDTH - right}" y1="{y:.1f}" y2="{y:.1f}"/>')
        parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{fmt_count(tick)}</text>')
        tick += step

    def bar(slot: int, count: int, low: float, high: float, fill: str) -> None:
        h = plot_h * count / y_top
        x = left + slot * slot_w
        tip = f"{fmt(low)} {DASH} {fmt(high)}: {count:,}" if high > low else f"{fmt(low)}: {count:,}"
        parts.append(
            f'<rect x="{x + 1:.1f}" y="{top + plot_h - h:.1f}" width="{max(slot_w - 2, 1):.1f}" '
            f'height="{h:.1f}" fill="{fill}" rx="2"><title>{escape(tip)}</title></rect>'
        )

    if hist.zeros:
        bar(0, hist.zeros, 0.0, 0.0, NEUTRAL)
        parts.append(
            f'<text x="{left + slot_w / 2:.1f}" y="{top + plot_h + 16}" text-anchor="middle">0</text>'
        )
    edges = hist.edges
    for i, count in enumerate(hist.counts):
        if count:
            bar(i + zero_slot, count, edges[i], edges[i + 1], color)
    # x labels: about six edges, evenly spread
    if edges:
        every = max(1, math.ceil(len(hist.counts) / 6))
        for i in range(0, len(edges), every):
            x = left + (i + zero_slot) * slot_w
            parts.append(
                f'<text x="{x:.1f}" y="{top + plot_h + 16}" text-anchor="middle">{fmt(edges[i])}</text>'
            )
        if (len(edges) - 1) % every:
            x = left + (len(edges) - 1 + zero_slot) * slot_w
            parts.append(
                f'<text x="{x:.1f}" y="{top + plot_h + 16}" text-anchor="middle">{fmt(edges[-1])}</text>'
            )
    axis_y = top + plot_h
    parts.append(f'<line class="axis" x1="{left}" x2="{WIDTH - right}" y1="{axis_y}" y2="{axis_y}"/>')
    scale_note = "log scale" if hist.log else "linear scale"
    parts.append(
        f'<text x="{left + plot_w / 2:.1f}" y="{height - 6}" text-anchor="middle">{escape(label)} '
        f"({scale_note})</text>"
    )

    def x_of(value: float) -> float | None:
        if value <= 0:
            return left + slot_w / 2 if hist.zeros else None
        if not edges:
            return None
        low, high = edges[0], edges[-1]
        if high <= low:
            return left + zero_slot * slot_w + (plot_w - zero_slot * slot_w) / 2
        if hist.log:
            position = math.log(max(value, low) / low) / math.log(high / low)
        else:
            position = (value - low) / (high - low)
        return left + zero_slot * slot_w + min(max(position, 0.0), 1.0) * len(hist.counts) * slot_w

    # p50/p90/p99: dashed lines, labelled in a row above the plot (never over the bars)
    label_x = float(left)
    for q, dash in ((50, "none"), (90, "5 3"), (99, "2 2")):
        mark = marks[q]
        mark_x = None if mark is None else x_of(mark)
        if mark_x is None or mark is None:
            continue
        value = mark
        parts.append(
            f'<line x1="{mark_x:.1f}" x2="{mark_x:.1f}" y1="{top - 4}" y2="{axis_y}" stroke="#1d2433" '
            f'stroke-width="1.3" stroke-dasharray="{dash}"><title>p{q} {escape(fmt(value))}</title></line>'
        )
        text = f"p{q} {fmt(value)}"
        parts.append(
            f'<line x1="{label_x:.1f}" x2="{label_x + 18:.1f}" y1="{top - 22}" y2="{top - 22}" '
            'stroke="#1d2433" '
            f'stroke-width="1.3" stroke-dasharray="{dash}"/>'
            f'<text x="{label_x + 22:.1f}" y="{top - 18}" class="mark">{escape(text)}</text>'
        )
        label_x += 36 + 6.5 * len(text)
    parts.append("</svg>")
    return "".join(parts)


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
            f"<title>{_tip(label)}</title>{escape(shorten(label, label_chars))}</text>"
        )
        parts.append(
            f'<rect x="{label_w}" y="{y + 4}" width="{w:.1f}" height="{row_h - 8}" fill="{color}" rx="3">'
            f"<title>{_tip(label)}: {escape(fmt(value))}{share}</title></rect>"
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
) -> str:
    """Horizontal stacked bars (tokens in / out per model) with a legend."""
    if not items:
        return _empty_svg(empty, 80)
    row_h, top, label_w, value_w = 26, 26, 200, 80
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
            f"<title>{_tip(label)}</title>{escape(shorten(label, label_chars))}</text>"
        )
        x0 = float(label_w)
        for (name, color), value in zip(series, values, strict=True):
            w = plot_w * (value or 0) / peak
            if w > 0:
                parts.append(
                    f'<rect x="{x0:.1f}" y="{y + 4}" width="{w:.1f}" height="{row_h - 8}" fill="{color}">'
                    f"<title>{_tip(label)} {escape(name)}: {fmt_int(value)}</title></rect>"
                )
            x0 += w
        known = [value for value in values if value is not None]
        total = fmt_count(sum(known)) if known else "unknown"
        parts.append(f'<text x="{x0 + 6:.1f}" y="{y + row_h / 2 + 4:.1f}">{total}</text>')
    parts.append("</svg>")
    return "".join(parts)


# ---------------------------------------------------------------------- page


def _kpi(label: str, value: str, note: str = "", state: str = "") -> str:
    cls = f"kpi {state}".strip()
    note_html = f'<div class="note">{escape(note)}</div>' if note else ""
    return (
        f'<div class="{cls}"><div class="label">{escape(label)}</div>'
        f'<div class="value">{escape(value)}</div>{note_html}</div>'
    )


def _card(title: str, body: str, hint: str = "", *, wide: bool = False) -> str:
    hint_html = f'<p class="hint">{escape(hint)}</p>' if hint else ""
    cls = "card wide" if wide else "card"
    return f'<section class="{cls}"><h3>{escape(title)}</h3>{hint_html}{body}</section>'


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]], numeric: Iterable[int] = ()) -> str:
    right = set(numeric)
    head = "".join(
        f'<th class="n">{escape(h)}</th>' if i in right else f"<th>{escape(h)}</th>"
        for i, h in enumerate(headers)
    )
    body = []
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            classes = []
            if i in right:
                classes.append("n")
            text = cell
            if isinstance(cell, tuple):  # (html, extra class)
                text, extra = cell
                classes.append(extra)
                cells.append(f'<td class="{" ".join(classes)}">{text}</td>')
                continue
            attr = f' class="{" ".join(classes)}"' if classes else ""
            cells.append(f"<td{attr}>{escape(str(text))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    if not body:
        body.append(f'<tr><td colspan="{len(headers)}" style="color:#9aa3b2">none</td></tr>')
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _share_cell(part: int, whole: int) -> Any:
    share = part / whole if whole else 0.0
    text = escape(fmt_share(part, whole))
    return (text, "bad") if share > FAIL_SHARE_WARN else text


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("rollout-capture")
    except Exception:
        return "unknown"


def render_report(
    summary: EvidenceSummary,
    *,
    title: str = "enriched rollouts",
    unreadable_lines: int = 0,
    generated_at: float | None = None,
) -> str:
    """The report as one HTML document (a string); ``title`` names the input shown in the header.

    Every name a record carries (model, gap code, error category, rollout id) is escaped and
    shortened, and every table and chart shows at most :data:`MAX_ROWS` of them, so the page
    stays small and inert whatever the input holds.
    """
    s = summary
    title = shorten(title, 200)
    failed_bad = s.failed_share > FAIL_SHARE_WARN
    gaps_bad = s.gap_share > FAIL_SHARE_WARN
    lat, ttft, hold = (_percentile_marks(x) for x in (s.latency_ms, s.ttft_ms, s.capture_hold_ms))
    tokens = _percentile_marks(s.tokens_per_rollout)
    stamp = time.strftime(
        "%Y-%m-%d %H:%M UTC", time.gmtime(generated_at if generated_at is not None else time.time())
    )

    kpis = [
        _kpi(
            "Rollouts",
            fmt_int(s.rollouts),
            f"{_plural(s.records_without_capture, 'record')} without capture"
            if s.records_without_capture
            else "",
        ),
        _kpi("Model calls", fmt_int(s.calls), tokens_text(s.tokens_total, s.tokens_total_unknown_calls)),
        _kpi(
            "Failed calls",
            fmt_int(s.failed_calls),
            f"{fmt_share(s.failed_calls, s.calls)} of calls",
            "bad" if failed_bad else ("good" if s.calls and not s.failed_calls else ""),
        ),
        _kpi(
            "Rollouts with gaps",
            fmt_int(s.rollouts_with_gaps),
            f"{fmt_share(s.rollouts_with_gaps, s.rollouts)} of rollouts",
            "bad" if gaps_bad else ("good" if s.rollouts and not s.rollouts_with_gaps else ""),
        ),
        _kpi("Latency p50", fmt_ms(lat[50]), f"p99 {fmt_ms(lat[99])}"),
        _kpi("TTFT p50", fmt_ms(ttft[50]), f"p99 {fmt_ms(ttft[99])}"),
        _kpi(
            "Capture hold p50",
            fmt_ms(hold[50]),
            f"p99 {fmt_ms(hold[99])}, what capture cost the first byte"
            if s.capture_hold_ms.count
            else "no call held for its capture",
        ),
        _kpi("Tokens / rollout", fmt_count(tokens[50]), f"p50 · p99 {fmt_count(tokens[99])}"),
        _kpi(
            "Orphan captures",
            fmt_int(s.orphan_captures),
            "captures no input line names",
            "bad" if s.orphan_captures else "",
        ),
    ]

    def items(counts: Mapping[str, int], color: Any) -> list[tuple[str, float, str]]:
        return [(key, float(n), color(key)) for key, n in top_counts(counts)]

    all_gaps = {**s.gaps, **s.observation_gaps}
    models = s.models_by_calls()[:MAX_ROWS]  # at most MAX_MODELS + 1 are counted anyway
    model_call_items = [(name, float(m.calls), BLUE) for name, m in models]
    model_token_items = [(name, [m.tokens_in, m.tokens_out]) for name, m in models]

    charts = [
        _card(
            "Latency per call",
            histogram_svg(s.latency_ms, label="latency", fmt=fmt_ms, color=BLUE),
            f"{fmt_int(s.latency_ms.count)} calls report a latency",
        ),
        _card(
            "Time to first token per call",
            histogram_svg(s.ttft_ms, label="TTFT", fmt=fmt_ms, color=TEAL),
            f"{fmt_int(s.ttft_ms.count)} calls report a TTFT",
        ),
        _card(
            "Tokens per rollout",
            histogram_svg(s.tokens_per_rollout, label="tokens total", fmt=fmt_count, color="#7a5bd1"),
            f"{fmt_int(s.tokens_per_rollout.count)} rollouts report tokens",
        ),
        _card(
            "Calls by status class",
            bars_svg(
                items(s.calls_by_status_class, lambda key: STATUS_COLORS.get(key, NEUTRAL)),
                empty="no calls",
                total=s.calls,
            ),
            "no status: the call got no HTTP answer (connection, cancelled)",
        ),
        _card(
            "Calls by error category",
            bars_svg(
                items(s.calls_by_error_category, lambda _: BAD),
                empty="no call has an error category",
                total=s.calls,
            ),
        ),
        _card(
            "Rollouts by gap code",
            bars_svg(
                items(all_gaps, lambda key: ORANGE if key in s.gaps else WARN),
                empty="no gaps",
                total=s.rollouts,
                label_chars=34,
            ),
            "a rollout is counted once per code it has",
        ),
        _card("Calls per model", bars_svg(model_call_items, empty="no calls", total=s.calls)),
        _card(
            "Tokens per model",
            stacked_bars_svg(
                model_token_items, [("tokens in", BLUE), ("tokens out", TEAL)], empty="no tokens"
            ),
            "unknown: no call of the model reported usage",
        ),
    ]

    def approx(sketch: Sketch) -> str:
        return "exact" if sketch.exact else "within 1 %"

    distribution_rows = [
        (
            label,
            fmt(p[50]),
            fmt(p[90]),
            fmt(p[99]),
            fmt(sketch.mean),
            fmt(sketch.max),
            fmt_int(sketch.count),
            approx(sketch),
        )
        for label, sketch, p, fmt in (
            ("latency", s.latency_ms, lat, fmt_ms),
            ("TTFT", s.ttft_ms, ttft, fmt_ms),
            ("capture hold", s.capture_hold_ms, hold, fmt_ms),
            ("tokens per rollout", s.tokens_per_rollout, tokens, fmt_int),
            ("calls per rollout", s.calls_per_rollout, _percentile_marks(s.calls_per_rollout), fmt_int),
        )
    ]

    def rows_of(counts: Mapping[str, int], row: Any) -> list[Sequence[Any]]:
        """The table rows of the largest counts, the rest in one row of the same shape."""
        return [row(key, n) for key, n in top_counts(counts)]

    status_rows = rows_of(
        s.calls_by_status_class,
        lambda k, n: (
            (_name_html(k, tag="span"), ""),
            fmt_int(n),
            _share_cell(n, s.calls) if k != "2xx" else fmt_share(n, s.calls),
        ),
    )
    category_rows = rows_of(
        s.calls_by_error_category,
        lambda k, n: (
            (_name_html(k), "code"),
            fmt_int(n),
            _share_cell(n, s.calls),
            _names_cell(s.failure_examples.get(k, [])),
        ),
    )
    model_rows = [_model_row(name, m) for name, m in models]
    gap_rows = rows_of(
        all_gaps,
        lambda code, n: (
            (_name_html(code), "code"),
            "capture" if code in s.gaps else "ownership" if code in s.observation_gaps else "",
            fmt_int(n),
            _share_cell(n, s.rollouts),
            _names_cell(s.gap_examples.get(code, [])),
        ),
    )
    orphan_rows = [
        ((_name_html(o), "id"), shorten(s.orphan_near.get(o, ""), NAME_CHARS)) for o in s.orphan_examples
    ]
    dialect_rows = rows_of(s.calls_by_dialect, lambda k, n: ((_name_html(k, tag="span"), ""), fmt_int(n)))

    subtitle = (
        f"{fmt_int(s.rollouts)} rollouts · {fmt_int(s.calls)} calls · "
        f"{fmt_int(s.failed_calls)} failed ({fmt_share(s.failed_calls, s.calls)}) · "
        f"{fmt_int(s.rollouts_with_gaps)} rollouts with gaps ({fmt_share(s.rollouts_with_gaps, s.rollouts)})"
    )
    if unreadable_lines:
        subtitle += f" · {fmt_int(unreadable_lines)} lines not JSON"
    tables = [
        _card(
            "Distributions",
            _table(
                ["", "p50", "p90", "p99", "mean", "max", "n", "percentiles"], distribution_rows, range(1, 7)
            ),
            "nearest-rank percentiles; capture hold: how long an answer's first byte waited for its "
            "capture claim (what capture cost)",
            wide=True,
        ),
        _card("Calls by status class", _table(["status class", "calls", "share"], status_rows, (1, 2))),
        _card(
            "Calls by error category",
            _table(["error category", "calls", "share", "first rollout ids"], category_rows, (1, 2)),
            "the rollouts that failed: the first few of each category",
        ),
        _card("Calls by dialect", _table(["dialect", "calls"], dialect_rows, (1,))),
    ]
    model_headers = ["model", "calls", "failed", "tokens in", "tokens out", "tokens total", "mean latency"]
    model_table = _card(
        "Calls and tokens per model",
        _table(model_headers, model_rows, range(1, 7)),
        "token sums are over the calls that reported usage: unknown when none did",
    )
    gap_headers = ["code", "kind", "rollouts", "share", "first rollout ids"]
    gap_table = _card("Rollouts by gap code", _table(gap_headers, gap_rows, (2, 3)))
    orphan_table = _card(
        f"{_plural(s.orphan_captures, 'rollout id')} under the capture root that no input line names",
        _table(["rollout id", "input id it may be meant as"], orphan_rows),
        "their calls are in no enriched record" if s.orphan_captures else "",
    )
    footer = f"rollout-capture {_version()} · generated {stamp} · self-contained, works offline"
    body = (
        f"<main><header><h1>Evidence report: {escape(title)}</h1>"
        f'<p class="sub">{escape(subtitle)}</p></header>'
        f'<div class="kpis">{"".join(kpis)}</div>'
        f'<h2>Charts</h2><div class="grid">{"".join(charts)}</div>'
        f'<h2>Tables</h2><div class="grid">{"".join(tables)}</div>'
        f"<h2>Per model</h2>{model_table}<h2>Gaps</h2>{gap_table}<h2>Orphan captures</h2>{orphan_table}"
        f"<footer>{escape(footer)}</footer></main>"
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>Evidence report: {escape(title)}</title><style>{CSS}</style></head>"
        f"<body>{body}</body></html>\n"
    )


def _model_row(name: str, m: ModelStats) -> tuple[Any, ...]:
    """One model's row of the per-model table: its name shortened, unknown sums said so."""
    return (
        (_name_html(name), "model"),
        fmt_int(m.calls),
        fmt_int(m.failed_calls),
        _tokens_cell(m.tokens_in, m.tokens_in_unknown_calls),
        _tokens_cell(m.tokens_out, m.tokens_out_unknown_calls),
        _tokens_cell(m.tokens_total, m.tokens_total_unknown_calls),
        fmt_ms(m.mean_latency_ms),
    )


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
