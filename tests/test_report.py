"""Evidence a person can see (issue 16): the HTML report, in a real headless Chromium too.

The corpus built here also serves the summary's tests (tests/test_summary.py), the Parquet
tables' (tests/test_export.py) and the CLI's. It is hand-built with known numbers, written
as real capture rows into a real store and enriched by the real merge, so every figure can
be checked by hand.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollout_capture import CaptureStore, merge_model_call_capture_into_record
from rollout_capture.report import default_report_path, render_report, write_report
from rollout_capture.summary import (
    AttachmentFold,
    EvidenceSummary,
    capture_ids_from_names,
    summarize_file,
)

NOTES = Path("/work/notes")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")

MODEL_A, MODEL_B = "model-a", "model-b"
# Calls 0..99 (rollout r-k holds calls 5k..5k+4): latency 10*(i+1) ms, TTFT a tenth of it.
FAILURES = {
    **{i: (500, "upstream_error") for i in (7, 17, 27, 37, 47, 57)},
    **{i: (429, "rate_limit") for i in (66, 76)},
    86: (None, "connection"),
    96: (200, "stream_truncated"),
}


def _row(i: int, failures: bool) -> dict[str, Any]:
    model = MODEL_A if i < 60 else MODEL_B
    status, category = FAILURES.get(i, (200, None)) if failures else (200, None)
    tokens_in, tokens_out = (100, 10) if model == MODEL_A else (200, 20)
    started = 1_780_000_000.0 + i
    return {
        "model_call_id": f"{i:032x}",
        "dialect": "chat",
        "model_ref": {"type": "responses_api_models", "name": "policy_model"},
        "started_at": started,
        "completed_at": started + (i + 1) / 100,
        "latency_ms": 10.0 * (i + 1),
        "latency_ttft_ms": 1.0 * (i + 1),
        "status_code": status,
        "error_category": category,
        "request": {"model": model, "messages": [{"role": "user", "content": "hi"}]},
        "response": {
            "id": f"chatcmpl-{i}",
            "model": model,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
            ],
            "usage": {
                "prompt_tokens": tokens_in,
                "completion_tokens": tokens_out,
                "total_tokens": tokens_in + tokens_out,
            },
        },
    }


def build_corpus(root: Path, *, failures: bool = True) -> tuple[Path, Path]:
    """Captures under ``root/captures`` and the enriched JSONL ``root/enriched.jsonl``.

    20 rollouts ``r-0`` .. ``r-19`` of 5 calls each (``r-0`` .. ``r-11`` model-a, the rest model-b),
    ``r-3`` marked incomplete, ``r-5`` with agent observations owning one call of five; ``r-20``
    and ``24-1-a1`` without captures, while ``24-1`` (the harness dropped the attempt suffix) is
    an orphan capture; one record without an id and one line that is not JSON.
    """
    captures = root / "captures"
    captures.mkdir(parents=True)
    store = CaptureStore(captures)
    records: list[dict[str, Any] | bytes] = []
    for k in range(20):
        rollout_id = f"r-{k}"
        for i in range(5 * k, 5 * k + 5):
            store.record(rollout_id, _row(i, failures))
        record: dict[str, Any] = {"_ng_rollout_id": rollout_id, "reward": float(k % 2)}
        if k == 5:
            record["ng_agent_observations"] = {
                "source": "test",
                "invocations": [{"invocation_id": "inv-1", "model_calls": [{"model_call_id": f"{25:032x}"}]}],
                "gaps": [],
            }
        records.append(record)
    if failures:  # a poor run: also a torn capture, two rollouts without any, an orphan
        store.mark_incomplete("r-3")
        store.record("24-1", _row(0, failures))
        records.append({"_ng_rollout_id": "r-20", "reward": 0.0})
        records.append({"_ng_task_index": 24, "_ng_rollout_index": 1, "_ng_attempt_index": 1, "reward": 1.0})
    records.append({"note": "no id: passed through"})
    records.append(b"<not json>")
    lines = []
    for item in records:
        if isinstance(item, bytes):
            lines.append(item)
        else:
            lines.append(orjson.dumps(merge_model_call_capture_into_record(item, [captures])))
    enriched = root / "enriched.jsonl"
    enriched.write_bytes(b"\n".join(lines) + b"\n")
    return captures, enriched


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[Path, Path]:
    return build_corpus(tmp_path / "bad")


def _input_ids(enriched: Path) -> set[str]:
    out = set()
    for line in enriched.read_bytes().splitlines():
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if "ng_model_call_capture" in record:
            out.add(record["ng_model_call_capture"]["rollout_id"])
    return out


# ---------------------------------------------------------------------- report


# The browser's own background traffic (component updates, network time, sign-in), which it
# sends for an empty page too; anything else that reaches the trap was asked for by the page.
BROWSER_HOSTS = re.compile(r"(^|\.)(google\.com|googleapis\.com|gvt1\.com|gstatic\.com)$")


class _RequestTrap:
    """A proxy that answers nothing and records the host of every request a browser sends it."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.requests: list[bytes] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    self.requests.append(conn.recv(4096))
                except OSError:
                    self.requests.append(b"? ?")

    def hosts(self) -> set[str]:
        """Hosts asked for, the browser's own services left out."""
        out = set()
        for request in self.requests:
            if not request:  # a connection opened and closed unused (a preconnect): no request
                continue
            line = request.split(b"\r\n", 1)[0].split(b" ")
            target = (line[1] if len(line) > 1 else line[0]).decode(errors="replace")
            host = re.sub(r"^[a-z]+://", "", target).split("/", 1)[0].rsplit(":", 1)[0]
            if not BROWSER_HOSTS.search(host):
                out.add(host)
        return out

    def close(self) -> None:
        self.sock.close()


def _chromium(url: str, *args: str, proxy_port: int, home: Path) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    return subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            "--hide-scrollbars",
            "--disable-background-networking",
            "--disable-component-update",
            "--no-first-run",
            f"--user-data-dir={home}",
            f"--proxy-server=http://127.0.0.1:{proxy_port}",
            "--proxy-bypass-list=<-loopback>",
            *args,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HOME": str(home)},
        check=False,
    )


def test_the_report_is_self_contained(corpus: tuple[Path, Path], tmp_path: Path) -> None:
    _, enriched = corpus
    write_report(enriched, tmp_path / "r.html")
    html = (tmp_path / "r.html").read_text()
    assert not re.search(r"""(src|href|action)\s*=\s*["']?\s*(https?:)?//""", html, re.I)
    assert "<script" not in html.lower() and "@import" not in html and "url(" not in html
    assert html.count("<svg") == 8
    assert "Evidence report: enriched.jsonl" in html
    # what a record says is text, never markup
    hostile = EvidenceSummary()
    call = {"model": "<script>alert(1)</script>", "status_code": 200, "dialect": "chat"}
    hostile.add({"ng_model_call_capture": {"rollout_id": "x", "metrics": {}, "calls": [call]}})
    page = render_report(hostile, title='<img src="http://evil.example/">')
    assert "<script" not in page and "<img" not in page and "&lt;script&gt;" in page
    assert default_report_path("s3://b/runs/enriched.jsonl") == "s3://b/runs/enriched.report.html"
    assert default_report_path("out.jsonl.gz") == "out.report.html"


def test_poor_runs_look_poor_and_good_runs_do_not(corpus: tuple[Path, Path], tmp_path: Path) -> None:
    bad = summarize_file(corpus[1])[0]
    good = summarize_file(build_corpus(tmp_path / "good", failures=False)[1])[0]
    bad_html, good_html = render_report(bad), render_report(good)
    # failed calls 10 % and gapped rollouts 3/22 are above 5 %: red cards and cells
    assert re.search(r'class="kpi bad"><div class="label">Failed calls', bad_html)
    assert re.search(r'class="kpi bad"><div class="label">Rollouts with gaps', bad_html)
    assert '<td class="n bad">6.0%</td>' in bad_html  # upstream_error share
    assert 'class="kpi bad"' not in good_html and 'class="n bad"' not in good_html
    assert good.failed_calls == 0


def _dom_and_screenshot(
    report: Path, trap: _RequestTrap, tmp_path: Path, *, height: int
) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str], Path]:
    """The page's DOM and a screenshot of it (1280 px wide), both through the request trap."""
    home = tmp_path / "home"
    dom = _chromium(report.as_uri(), "--dump-dom", proxy_port=trap.port, home=home)
    shot = tmp_path / "report.png"
    size = f"--window-size=1280,{height}"
    taken = _chromium(report.as_uri(), f"--screenshot={shot}", size, proxy_port=trap.port, home=home)
    return dom, taken, shot


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium: apt-get install -y chromium")
def test_the_report_renders_in_headless_chromium_without_a_request(
    corpus: tuple[Path, Path], tmp_path: Path
) -> None:
    captures, enriched = corpus
    summary = summarize_file(enriched)[0]
    summary.set_orphans(capture_ids_from_names(os.listdir(captures)), _input_ids(enriched))
    report = tmp_path / "report.html"
    write_report(summary, report, title=enriched.name)
    probe = tmp_path / "probe.html"  # the control: a page that does ask for something
    probe.write_text('<html><body><img src="http://probe.example/pixel.png"></body></html>')
    trap = _RequestTrap()
    try:
        _chromium(probe.as_uri(), "--dump-dom", proxy_port=trap.port, home=tmp_path / "home")
        assert "probe.example" in trap.hosts()  # the trap sees what a page asks for
        trap.requests.clear()
        dom, taken, shot = _dom_and_screenshot(report, trap, tmp_path, height=2600)
    finally:
        trap.close()
    assert dom.returncode == 0, dom.stderr[-2000:]
    rendered = dom.stdout
    assert rendered.count("<svg") == 8 and rendered.count("<rect") > 40
    for label in ("latency histogram", "TTFT histogram", "tokens total histogram"):
        assert f'aria-label="{label}"' in rendered
    for text in (
        "upstream_error",
        "rate_limit",
        "model_call_capture_no_records",
        "model-a",
        "24-1-a1",
        "p99 990 ms",
    ):
        assert text in rendered
    assert trap.hosts() == set()  # the report asked for nothing outside the file
    assert taken.returncode == 0 and shot.stat().st_size > 50_000, taken.stderr[-2000:]
    if NOTES.is_dir():
        shutil.copyfile(shot, NOTES / "report.png")


# ---------------------------------------------------------------------- figures people read


def _attachment(rollout_id: str, *calls: dict[str, Any], gaps: Sequence[str] = ()) -> dict[str, Any]:
    attachment: dict[str, Any] = {"rollout_id": rollout_id, "metrics": {}, "calls": list(calls)}
    if gaps:
        attachment["gaps"] = [{"code": code} for code in gaps]
    return attachment


def _call(**fields: Any) -> dict[str, Any]:
    return {"status_code": 200, "dialect": "chat", "model": "m", **fields}


def test_unknown_tokens_are_shown_unknown_and_mixed_sums_say_how_many_calls(tmp_path: Path) -> None:
    summary = EvidenceSummary()
    silent = [_call(model="m-silent", status_code=None, error_category="connection") for _ in range(15)]
    summary.add_attachment(_attachment("r-1", *silent))
    page = render_report(summary)
    assert "tokens unknown" in page  # the calls card
    row = re.search(r"<tr><td class=\"model\"><code>m-silent</code></td>(.*?)</tr>", page)
    assert row is not None
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row.group(1))
    assert cells[:6] == ["", "15", "15", "unknown", "unknown", "unknown"]  # answered as: no name
    summary.add_attachment(_attachment("r-2", _call(model="m-silent", tokens_total=1234)))
    page = render_report(summary)
    assert "1,234 tokens (15 calls unknown)" in page and "1,234 (15 calls unknown)" in page


def test_the_card_and_the_chart_show_one_percentile_alike() -> None:
    """p99 on the card and in the chart's legend are one value, formatted once (2.52 s, not 2.51)."""
    summary = EvidenceSummary()
    summary.add_attachment(_attachment("r-1", *[_call(latency_total_ms=2515.4) for _ in range(3)]))
    page = render_report(summary)
    card = re.search(
        r'Latency p50</div><div class="value">[^<]*</div><div class="note">p99 ([^<]*)</div>', page
    )
    legend = re.search(r'class="mark">p99 ([^<]*)</text>', page)
    assert card is not None and legend is not None
    assert card.group(1) == legend.group(1) == "2.52 s"


def test_the_report_names_the_rollouts_that_failed(corpus: tuple[Path, Path], tmp_path: Path) -> None:
    _, enriched = corpus
    page = render_report(summarize_file(enriched)[0])
    # calls 7, 17, 27, 37, 47, 57 failed upstream (rollouts r-1, r-3, r-5, r-7, r-9, r-11: the first 5)
    row = re.search(r"<code>upstream_error</code></td>(.*?)</tr>", page)
    assert row is not None
    assert re.findall(r"<code>(r-\d+)</code>", row.group(1)) == ["r-1", "r-3", "r-5", "r-7", "r-9"]
    connection = re.search(r"<code>connection</code></td>(.*?)</tr>", page)
    assert connection is not None and "<code>r-17</code>" in connection.group(1)


HOSTILE = '<img src=x onerror="alert(1)">'


def test_a_hostile_input_of_10k_rollouts_makes_a_small_inert_page() -> None:
    """Names a record carries are escaped, shortened (full in a capped tooltip) and at most
    30 a table: 10k rollouts, each with its own 10 kB model, category and gap code, a 2 MB
    model name among them, stay under 2 MB."""
    summary = EvidenceSummary()
    fold = AttachmentFold(summary)
    huge = "M" * 2_000_000
    for k in range(10_000):
        pad = f"{k:05d}" + "x" * 10_000
        call = _call(
            model=huge if k < 100 else f"{HOSTILE}{pad}",
            status_code=k,
            error_category=f"{HOSTILE}{pad}",
            dialect=f"{HOSTILE}{pad}",
            latency_total_ms=-5000.0 if k % 2 else float(k),
        )
        fold.add(_attachment(f"{HOSTILE}{pad}", call, gaps=[f"{HOSTILE}{pad}"]))
    fold.flush()
    page = render_report(summary, title=HOSTILE * 1000)
    assert len(page.encode()) < 2_000_000
    assert "<img" not in page and "&lt;img" in page
    assert 'title="MMMM' in page  # the long name is in its tooltip, capped
    assert "(9,970 more)" in page  # gap codes past the 30 shown, summed in one row
    assert "-5000" not in page and "-5.00 s" not in page  # impossible latencies are in no figure


def test_a_gap_code_is_text_in_the_gap_table() -> None:
    summary = EvidenceSummary()
    summary.add_attachment(_attachment("r-1", _call(), gaps=[HOSTILE]))
    summary.add(
        {
            "ng_model_call_capture": _attachment("r-2"),
            "ng_agent_observations": {"gaps": [{"code": HOSTILE + "o"}]},
        }
    )
    page = render_report(summary)
    assert "<img" not in page
    assert page.count("<code>&lt;img src=x onerror=&quot;alert(1)&quot;&gt;") == 2  # both codes, as text


# ---------------------------------------------------------------------- what the flows print


def test_a_share_equal_to_its_threshold_is_not_poor() -> None:
    """Strictly above: ``max_gap_share=0`` never flags a clean run, 1 of 4 is not above 25 %."""
    from rollout_capture.batch import BatchStats
    from rollout_capture.flows.report import EnrichSummary, final_state, poor_evidence

    for stats, threshold in (
        (BatchStats(rollouts=4), 0.0),
        (BatchStats(rollouts=4, rollouts_with_gaps=1), 0.25),
    ):
        summary = EnrichSummary(source="in.jsonl", output="out.jsonl", batches=1, seconds=0.0, stats=stats)
        assert poor_evidence(stats, threshold, threshold) == []
        assert final_state(summary, threshold, threshold) is summary
    above = BatchStats(rollouts=4, rollouts_with_gaps=2)
    summary = EnrichSummary(source="in.jsonl", output="out.jsonl", batches=1, seconds=0.0, stats=above)
    assert getattr(final_state(summary, 0.25, None), "name", None) == "Completed with gaps"


def _silent_row(i: int) -> dict[str, Any]:
    """A call answered 200 that reported no usage and no timing: every figure of it is unknown."""
    row = _row(i, failures=False)
    del row["response"]["usage"]
    row["latency_ms"] = row["latency_ttft_ms"] = None
    return row


@pytest.mark.usefixtures("prefect_api")
def test_a_run_of_unknown_figures_says_unknown_everywhere(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Tokens no call reported and latencies none recorded are "unknown" in the log line, the
    artifacts, the digest and the terminal's rows, never 0 or ``None``; and a clean run with
    ``max_gap_share=0`` is plainly Completed."""
    from rollout_capture.cli.commands.enrich import evidence_rows as _evidence_rows
    from rollout_capture.flows import enrich_rollouts
    from rollout_capture.flows.report import artifact_key

    from .support.prefect_api import artifacts

    captures = tmp_path / "captures"
    store = CaptureStore(captures)
    for i in range(3):
        store.record(f"r-{i}", _silent_row(i))
    source = tmp_path / "rollouts.jsonl"
    source.write_bytes(b"".join(orjson.dumps({"_ng_rollout_id": f"r-{i}"}) + b"\n" for i in range(3)))
    caplog.set_level(logging.INFO, logger="prefect.flow_runs")

    state = enrich_rollouts(
        str(source), str(captures), max_gap_share=0.0, max_failed_share=0.0, return_state=True
    )

    assert state.name == "Completed"
    summary = state.result()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("enriched 3 rollout(s)")]
    assert "latency p50/p99 unknown" in line and "TTFT p50/p99 unknown" in line
    assert "tokens in / out / total unknown / unknown / unknown" in line and "None" not in line
    evidence = summary.stats.evidence
    assert (
        summary.stats.tokens_total is None and evidence.digest()["models"]["model-a"]["tokens_total"] is None
    )
    rows = dict(_evidence_rows(evidence))
    assert rows["model model-a"] == "3 call(s) (0 failed), tokens unknown"
    assert rows["latency p50 / p90 / p99"] == "unknown" and rows["capture hold p50 / p99"] == "unknown"
    published = {a.key: a for a in artifacts(state.state_details.flow_run_id) if a.key}
    output = str(tmp_path / "rollouts.enriched.jsonl")
    markdown = published[artifact_key("enrichment-summary", output)].data
    assert "- tokens in / out / total: unknown / unknown / unknown" in markdown
    assert "| model-a | 3 | 0 | unknown | unknown | unknown | 3 |" in markdown and "None" not in markdown
    table = {
        r["measure"]: r["value"] for r in orjson.loads(published[artifact_key("enrichment", output)].data)
    }
    assert table["tokens total"] == "unknown" and table["calls without tokens total"] == 3


def test_impossible_timings_are_a_gap_naming_the_call_read_either_way() -> None:
    """A negative duration or a call completed before it started is a gap naming the call, on
    the typed path and the full one alike; the page never shows it as a duration."""
    from tests.test_call_records_fast import BASE, both_ways

    lines = [
        orjson.dumps(BASE | {"model_call_id": "c1", "latency_ms": -5000, "latency_ttft_ms": -1.5}),
        orjson.dumps(BASE | {"model_call_id": "c2", "started_at": 10.0, "completed_at": 9.0}),
        orjson.dumps(BASE | {"model_call_id": "c3"}),
    ]
    full, typed, built = both_ways(lines)
    assert typed == full and built == 3
    attachment = orjson.loads(full)
    assert attachment["gaps"] == [
        {
            "code": "model_call_timing_impossible",
            "detail": "capture:c1:call_index=0: latency_total_ms=-5000.0, latency_ttft_ms=-1.5",
        },
        {
            "code": "model_call_timing_impossible",
            "detail": "capture:c2:call_index=1: completed_at=9.0 < started_at=10.0",
        },
    ]
    assert [c["latency_total_ms"] for c in attachment["calls"]] == [-5000, 500, 500]  # as recorded
    summary = EvidenceSummary()
    summary.add({"ng_model_call_capture": attachment})
    assert (summary.latency_ms.count, summary.latency_ms.min, summary.ttft_ms.count) == (2, 500.0, 0)
    assert summary.gap_examples == {"model_call_timing_impossible": ["r"]}
    page = render_report(summary)
    assert "<code>model_call_timing_impossible</code>" in page and ">0 ms<" not in page
    assert not re.search(r"-\d[\d.,]* (ms|s)\b", page)  # no negative duration anywhere


POLICY = {"type": "responses_api_models", "name": "policy_model"}


def _policy_run(*, no_status: bool) -> EvidenceSummary:
    """15 calls to ``policy-model`` that failed (no answer naming a model: the request's name, no
    usage) and 30 answered as ``policy-model-2026-01``, all through the model server ``policy_model``;
    and 5 calls of a judge answered as itself."""
    failed = [
        _call(
            model="policy-model",
            model_ref=POLICY,
            response_id=None,
            status_code=None if no_status else 503,
            error_category="connection" if no_status else "upstream_error",
        )
        for _ in range(15)
    ]
    answered = [
        _call(
            model="policy-model-2026-01",
            model_ref=POLICY,
            response_id=f"resp-{i}",
            tokens_in=100,
            tokens_out=20,
            tokens_total=120,
        )
        for i in range(30)
    ]
    judge = [
        _call(model="judge", response_id=f"j-{i}", tokens_in=10, tokens_out=1, tokens_total=11)
        for i in range(5)
    ]
    summary = EvidenceSummary()
    summary.add_attachment(_attachment("r-1", *failed[:7], *answered[:15], *judge))
    other = EvidenceSummary()  # a second batch: the grouping holds across merged summaries
    other.add_attachment(_attachment("r-2", *failed[7:], *answered[15:]))
    return summary.merge(other)


def test_one_model_is_one_row_under_the_name_it_asked_for() -> None:
    """Failed calls count under the request's name, answered ones under the answer's: one row,
    ``policy-model``, answered as ``policy-model-2026-01`` (it read as a second, broken model)."""
    summary = _policy_run(no_status=False)
    groups = {
        name: (served, m.calls, m.failed_calls, m.tokens_total) for name, served, m in summary.model_groups()
    }
    assert groups == {"policy-model": (["policy-model-2026-01"], 45, 15, 3600), "judge": ([], 5, 0, 55)}
    page = render_report(summary)
    rows = re.findall(r'<tr><td class="model"><code>([^<]*)</code></td><td class="model">(.*?)</td>', page)
    assert rows == [("policy-model", "<code>policy-model-2026-01</code>"), ("judge", "")]
    bars = re.findall(r'<svg[^>]*aria-label="no calls">(.*?)</svg>', page)[-1]  # calls per model
    assert re.findall(r"</title>([^<]*)</text>", bars) == ["policy-model", "judge"]
    assert summary.digest()["models"].keys() == {
        "policy-model",
        "policy-model-2026-01",
        "judge",
    }  # as recorded
    assert (
        "| policy-model (answered as policy-model-2026-01) | 45 | 15 |" in summary.to_markdown()
    )  # artifact


def test_a_note_explains_only_a_bar_that_is_drawn() -> None:
    """ "no status" under the status chart only when a call got no answer; the unknown tokens said
    beside the one model's bar that leaves calls out, not over the whole chart."""
    answered = render_report(_policy_run(no_status=False))
    assert "no status: the call got no HTTP answer" not in answered
    unanswered = render_report(_policy_run(no_status=True))
    assert "no status: the call got no HTTP answer" in unanswered
    tokens = re.search(r'aria-label="no tokens">(.*?)</svg>', unanswered)
    assert tokens is not None
    beside = re.findall(r'<text x="[^"]*" y="[^"]*">([^<]*)</text>', tokens.group(1))
    assert beside[-2:] == ["3.6k · 15 calls without usage", "55"], beside
    assert "unknown: no call of the model reported usage" not in unanswered


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium: apt-get install -y chromium")
def test_the_grouped_models_render_in_headless_chromium(tmp_path: Path) -> None:
    """The page with one model asked for and answered under another name, in Chromium: one row and
    one bar for it, the note beside its token bar; the screenshot kept for a person to look at."""
    report = tmp_path / "report.html"
    write_report(_policy_run(no_status=True), report, title="policy run")
    trap = _RequestTrap()
    try:
        dom, taken, shot = _dom_and_screenshot(report, trap, tmp_path, height=2200)
    finally:
        trap.close()
    assert dom.returncode == 0 and taken.returncode == 0, dom.stderr[-2000:] + taken.stderr[-2000:]
    rendered = dom.stdout
    assert (
        ">policy-model<" in rendered and rendered.count(">policy-model-2026-01<") == 1
    )  # its row's cell alone
    assert "15 calls without usage" in rendered and trap.hosts() == set()
    if NOTES.is_dir():
        shutil.copyfile(shot, NOTES / "report36.png")
