"""The report's HTML page: its sections (figures, charts, tables, per model, gaps, orphans)
each drawn by a function of its own from an :class:`EvidenceSummary`, and the document."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from html import escape
from typing import Any

from rollout_capture.report.charts import (
    BAD,
    BLUE,
    NEUTRAL,
    ORANGE,
    STATUS_COLORS,
    TEAL,
    WARN,
    bars_svg,
    histogram_svg,
    stacked_bars_svg,
)
from rollout_capture.report.formatting import (
    NAME_CHARS,
    fmt_count,
    fmt_int,
    fmt_ms,
    fmt_share,
    name_html,
    names_cell,
    percentile_marks,
    plural,
    tokens_cell,
)
from rollout_capture.summary import (
    FAIL_SHARE_WARN,
    MAX_ROWS,
    NO_STATUS,
    EvidenceSummary,
    ModelStats,
    Sketch,
    shorten,
    tokens_text,
    top_counts,
)

Marks = dict[int, float | None]
"""p50/p90/p99 of one sketch, as :func:`~rollout_capture.report.formatting.percentile_marks` gives them."""

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


ModelGroup = tuple[str, Sequence[str], ModelStats]
"""A model as asked for, the names that answered for it, its calls (``EvidenceSummary.model_groups``)."""


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
    lat, ttft, hold = (percentile_marks(x) for x in (s.latency_ms, s.ttft_ms, s.capture_hold_ms))
    tokens = percentile_marks(s.tokens_per_rollout)
    stamp = time.strftime(
        "%Y-%m-%d %H:%M UTC", time.gmtime(generated_at if generated_at is not None else time.time())
    )
    models = s.model_groups()[:MAX_ROWS]  # at most MAX_MODELS + 1 are counted anyway
    kpis = _kpis(s, lat, ttft, hold, tokens)
    charts = [*_distribution_charts(s), *_count_charts(s, models)]
    tables = [_distributions_card(s, lat, ttft, hold, tokens), *_count_tables(s)]
    footer = f"rollout-capture {_version()} · generated {stamp} · self-contained, works offline"
    body = (
        f"<main><header><h1>Evidence report: {escape(title)}</h1>"
        f'<p class="sub">{escape(_subtitle(s, unreadable_lines))}</p></header>'
        f'<div class="kpis">{"".join(kpis)}</div>'
        f'<h2>Charts</h2><div class="grid">{"".join(charts)}</div>'
        f'<h2>Tables</h2><div class="grid">{"".join(tables)}</div>'
        f"<h2>Per model</h2>{_model_card(models)}<h2>Gaps</h2>{_gap_card(s)}"
        f"<h2>Orphan captures</h2>{_orphan_card(s)}"
        f"<footer>{escape(footer)}</footer></main>"
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>Evidence report: {escape(title)}</title><style>{CSS}</style></head>"
        f"<body>{body}</body></html>\n"
    )


def _subtitle(s: EvidenceSummary, unreadable_lines: int) -> str:
    """The header's one line of totals."""
    subtitle = (
        f"{fmt_int(s.rollouts)} rollouts · {fmt_int(s.calls)} calls · "
        f"{fmt_int(s.failed_calls)} failed ({fmt_share(s.failed_calls, s.calls)}) · "
        f"{fmt_int(s.rollouts_with_gaps)} rollouts with gaps ({fmt_share(s.rollouts_with_gaps, s.rollouts)})"
    )
    if unreadable_lines:
        subtitle += f" · {fmt_int(unreadable_lines)} lines not JSON"
    return subtitle


def _kpis(s: EvidenceSummary, lat: Marks, ttft: Marks, hold: Marks, tokens: Marks) -> list[str]:
    """The row of headline figures; failed-call and gap shares above the threshold in red."""
    failed_bad = s.failed_share > FAIL_SHARE_WARN
    gaps_bad = s.gap_share > FAIL_SHARE_WARN
    return [
        _kpi(
            "Rollouts",
            fmt_int(s.rollouts),
            f"{plural(s.records_without_capture, 'record')} without capture"
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


def _distribution_charts(s: EvidenceSummary) -> list[str]:
    """The histograms: latency, TTFT, tokens per rollout."""
    return [
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
    ]


def _bar_items(counts: Mapping[str, int], color: Callable[[str], str]) -> list[tuple[str, float, str]]:
    """A bar chart's bars: the largest counts, the rest in one bar."""
    return [(key, float(n), color(key)) for key, n in top_counts(counts)]


def _count_charts(s: EvidenceSummary, models: Sequence[ModelGroup]) -> list[str]:
    """The bar charts: calls by status class, error category and model, rollouts by gap code.

    A note explains a bar only when that bar is drawn: "no status" under the status chart when
    some call got no answer; beside a model's token bar, the calls that reported no usage."""
    model_call_items = [(name, float(m.calls), BLUE) for name, _, m in models]
    model_token_items = [(name, [m.tokens_in, m.tokens_out]) for name, _, m in models]
    token_notes = [_tokens_note(m) for _, _, m in models]
    status_items = _bar_items(s.calls_by_status_class, lambda key: STATUS_COLORS.get(key, NEUTRAL))
    drawn = {label for label, _, _ in status_items}
    return [
        _card(
            "Calls by status class",
            bars_svg(status_items, empty="no calls", total=s.calls),
            "no status: the call got no HTTP answer (connection, cancelled)" if NO_STATUS in drawn else "",
        ),
        _card(
            "Calls by error category",
            bars_svg(
                _bar_items(s.calls_by_error_category, lambda _: BAD),
                empty="no call has an error category",
                total=s.calls,
            ),
        ),
        _card(
            "Rollouts by gap code",
            bars_svg(
                _bar_items({**s.gaps, **s.observation_gaps}, lambda key: ORANGE if key in s.gaps else WARN),
                empty="no gaps",
                total=s.rollouts,
                label_chars=34,
            ),
            "a rollout is counted once per code it has",
        ),
        _card(
            "Calls per model",
            bars_svg(model_call_items, empty="no calls", total=s.calls),
            "a model as asked for: the names that answered for it are in the per-model table"
            if any(served for _, served, _ in models)
            else "",
        ),
        _card(
            "Tokens per model",
            stacked_bars_svg(
                model_token_items,
                [("tokens in", BLUE), ("tokens out", TEAL)],
                empty="no tokens",
                notes=token_notes,
            ),
        ),
    ]


def _tokens_note(m: ModelStats) -> str:
    """Beside a model's token bar: the calls its sums leave out (none reported usage), if any."""
    unknown = max(m.tokens_in_unknown_calls, m.tokens_out_unknown_calls)
    if not unknown:
        return ""
    if m.tokens_in is None and m.tokens_out is None:
        return f"no usage reported ({plural(unknown, 'call')})"
    return f"{plural(unknown, 'call')} without usage"


def _distributions_card(s: EvidenceSummary, lat: Marks, ttft: Marks, hold: Marks, tokens: Marks) -> str:
    """The table of every distribution's percentiles, mean, max and count."""

    def approx(sketch: Sketch) -> str:
        return "exact" if sketch.exact else "within 1 %"

    rows = [
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
            ("calls per rollout", s.calls_per_rollout, percentile_marks(s.calls_per_rollout), fmt_int),
        )
    ]
    return _card(
        "Distributions",
        _table(["", "p50", "p90", "p99", "mean", "max", "n", "percentiles"], rows, range(1, 7)),
        "nearest-rank percentiles; capture hold: how long an answer's first byte waited for its "
        "capture claim (what capture cost)",
        wide=True,
    )


def _rows_of(counts: Mapping[str, int], row: Callable[[str, int], Sequence[Any]]) -> list[Sequence[Any]]:
    """The table rows of the largest counts, the rest in one row of the same shape."""
    return [row(key, n) for key, n in top_counts(counts)]


def _count_tables(s: EvidenceSummary) -> list[str]:
    """The tables of calls by status class, error category (naming failed rollouts) and dialect."""
    status_rows = _rows_of(
        s.calls_by_status_class,
        lambda k, n: (
            (name_html(k, tag="span"), ""),
            fmt_int(n),
            _share_cell(n, s.calls) if k != "2xx" else fmt_share(n, s.calls),
        ),
    )
    category_rows = _rows_of(
        s.calls_by_error_category,
        lambda k, n: (
            (name_html(k), "code"),
            fmt_int(n),
            _share_cell(n, s.calls),
            names_cell(s.failure_examples.get(k, [])),
        ),
    )
    dialect_rows = _rows_of(s.calls_by_dialect, lambda k, n: ((name_html(k, tag="span"), ""), fmt_int(n)))
    return [
        _card("Calls by status class", _table(["status class", "calls", "share"], status_rows, (1, 2))),
        _card(
            "Calls by error category",
            _table(["error category", "calls", "share", "first rollout ids"], category_rows, (1, 2)),
            "the rollouts that failed: the first few of each category",
        ),
        _card("Calls by dialect", _table(["dialect", "calls"], dialect_rows, (1,))),
    ]


def _model_card(models: Sequence[ModelGroup]) -> str:
    """Calls and tokens per model asked for, the names that answered for it beside: unknown sums said so."""
    model_headers = [
        "model",
        "answered as",
        "calls",
        "failed",
        "tokens in",
        "tokens out",
        "tokens total",
        "mean latency",
    ]
    return _card(
        "Calls and tokens per model",
        _table(model_headers, [_model_row(name, served, m) for name, served, m in models], range(2, 8)),
        "a call counts under the model it asked for; token sums are over the calls that reported "
        "usage: unknown when none did",
    )


def _model_row(name: str, served: Sequence[str], m: ModelStats) -> tuple[Any, ...]:
    """One model's row of the per-model table: its name shortened, the names that answered for it,
    unknown sums said so."""
    return (
        (name_html(name), "model"),
        (", ".join(name_html(other) for other in served), "model"),
        fmt_int(m.calls),
        fmt_int(m.failed_calls),
        tokens_cell(m.tokens_in, m.tokens_in_unknown_calls),
        tokens_cell(m.tokens_out, m.tokens_out_unknown_calls),
        tokens_cell(m.tokens_total, m.tokens_total_unknown_calls),
        fmt_ms(m.mean_latency_ms),
    )


def _gap_card(s: EvidenceSummary) -> str:
    """Rollouts by gap code, capture and ownership codes alike, naming the first rollouts of each."""
    gap_rows = _rows_of(
        {**s.gaps, **s.observation_gaps},
        lambda code, n: (
            (name_html(code), "code"),
            "capture" if code in s.gaps else "ownership" if code in s.observation_gaps else "",
            fmt_int(n),
            _share_cell(n, s.rollouts),
            names_cell(s.gap_examples.get(code, [])),
        ),
    )
    gap_headers = ["code", "kind", "rollouts", "share", "first rollout ids"]
    return _card("Rollouts by gap code", _table(gap_headers, gap_rows, (2, 3)))


def _orphan_card(s: EvidenceSummary) -> str:
    """The first orphan captures and the input id each may be meant as."""
    orphan_rows = [
        ((name_html(o), "id"), shorten(s.orphan_near.get(o, ""), NAME_CHARS)) for o in s.orphan_examples
    ]
    return _card(
        f"{plural(s.orphan_captures, 'rollout id')} under the capture root that no input line names",
        _table(["rollout id", "input id it may be meant as"], orphan_rows),
        "their calls are in no enriched record" if s.orphan_captures else "",
    )
