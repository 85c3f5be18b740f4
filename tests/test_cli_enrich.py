"""``enrich``, ``demo`` and ``enrich-runs`` (``cli/commands/enrich.py``), as a user runs them:
real processes, exit codes, summaries, messages naming the input."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .conftest import SAMPLE
from .support.cli import cli_env, run_at_terminal, run_cli


def test_enrich_the_sample(prefect_api: str, tmp_path: Path) -> None:
    out = tmp_path / "sample.enriched.jsonl"
    captures = ["--capture-dir", str(SAMPLE / "captures")]
    done = run_cli("enrich", str(SAMPLE / "rollouts.jsonl"), *captures, "--output", str(out), api=prefect_api)
    assert done.returncode == 0, done.stderr
    table = dict(re.split(r"\s+(?=\S+$)", line.strip(), maxsplit=1) for line in done.stdout.splitlines()[1:])
    assert table["rollouts enriched"] == "10" and table["lines passed through"] == "1"
    rows = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in done.stdout.splitlines())
    assert rows["gap model_call_capture_incomplete"] == "1 (first: 6-0)"  # which rollouts, named
    assert rows["failed calls"] == "0 (0.0%)" and rows["calls by status"] == "2xx 14"
    assert rows["latency p50 / p90 / p99"] == "2130 / 3294 / 3775 ms"  # whole ms
    assert rows["TTFT p50 / p90 / p99"] == "336 / 980 / 1016 ms"
    assert rows["model gpt-4.1-2025-04-14"] == "3 call(s) (0 failed), 2,635 tokens"
    assert rows["orphan captures"] == "0"
    assert rows["report"] == str(tmp_path / "sample.enriched.report.html")
    assert (tmp_path / "sample.enriched.report.html").is_file()
    assert done.stdout.splitlines()[0].split() == ["output", str(out)]
    assert "rollouts.jsonl:11: not JSON" in done.stderr  # the placeholder row, named
    assert "━" not in done.stderr  # no progress bar when not at a terminal
    assert len(out.read_bytes().splitlines()) == len((SAMPLE / "rollouts.jsonl").read_bytes().splitlines())


def test_json_summaries(prefect_api: str, tmp_path: Path) -> None:
    """``--json``: one machine-readable summary on stdout, for success and failure alike."""
    out = tmp_path / "sample.enriched.jsonl"
    captures = ["--capture-dir", str(SAMPLE / "captures")]
    done = run_cli(
        "enrich", str(SAMPLE / "rollouts.jsonl"), *captures, "--output", str(out), "--json", api=prefect_api
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["ok"] and summary["output"] == str(out) and summary["stats"]["rollouts"] == 10
    assert summary["stats"]["gaps"]["model_call_capture_incomplete"] == 1
    assert [p["line"] for p in summary["stats"]["problems"]] == [11]
    evidence = summary["evidence"]
    assert evidence["failed_calls"] == 0 and evidence["calls_by_status_class"] == {"2xx": 14}
    assert evidence["latency_ms"] == {"p50": 2130, "p90": 3294, "p99": 3775}
    assert evidence["gap_examples"]["model_call_capture_incomplete"] == ["6-0"]
    assert evidence["orphan_captures"] == 0 and summary["report"].endswith("sample.enriched.report.html")

    shown = json.loads(run_cli("inspect", "0-0", *captures, "--json").stdout)
    assert shown["rollout_id"] == "0-0" and shown["metrics"]["num_calls"] == len(shown["calls"]) > 0
    waited = json.loads(run_cli("wait", "0-0", *captures, "--json").stdout)
    assert waited == {"ok": True, "rollout_id": "0-0", "quiescent": True, "timeout_s": 10.0}

    failed = run_cli("enrich", str(tmp_path / "absent.jsonl"), *captures, "--json")
    assert failed.returncode == 2 and json.loads(failed.stdout) == {
        "ok": False,
        "exit_code": 2,
        "error": f"rollouts file not found: {tmp_path / 'absent.jsonl'}",
    }


def test_a_mistyped_capture_dir_exits_2_unless_empty_is_allowed(prefect_api: str, tmp_path: Path) -> None:
    rollouts = tmp_path / "r.jsonl"
    rollouts.write_bytes(b'{"_ng_task_index": 0, "_ng_rollout_index": 0}\n')
    wrong = tmp_path / "nonexistent" / "dir"
    done = run_cli("enrich", str(rollouts), "--capture-dir", str(wrong), api=prefect_api)
    assert done.returncode == 2 and f"error: capture dir {wrong} does not exist" in done.stderr
    assert not (tmp_path / "r.enriched.jsonl").exists()
    allowed = run_cli(
        "enrich", str(rollouts), "--capture-dir", str(wrong), "--allow-empty", "--json", api=prefect_api
    )
    assert allowed.returncode == 0 and json.loads(allowed.stdout)["stats"]["gaps"] == {
        "model_call_capture_no_records": 1
    }


def test_a_progress_bar_on_a_terminal(prefect_api: str, tmp_path: Path) -> None:
    """At a TTY the enrichment shows a bar (rich); piped, it stays quiet (the test above)."""
    code, text = run_at_terminal(
        "enrich",
        str(SAMPLE / "rollouts.jsonl"),
        "--capture-dir",
        str(SAMPLE / "captures"),
        "--output",
        str(tmp_path / "out.jsonl"),
        env=cli_env(prefect_api, COLUMNS="120"),
    )
    assert code == 0, text[-2000:]
    assert "━" in text and "sample/rollouts.jsonl" in text  # the bar, labelled by its input
    assert "rollouts enriched" in text


def test_missing_input_exits_2_naming_it(prefect_api: str, tmp_path: Path) -> None:
    done = run_cli("enrich", str(tmp_path / "absent.jsonl"), "--capture-dir", str(tmp_path), api=prefect_api)
    assert done.returncode == 2
    assert done.stderr == f"error: rollouts file not found: {tmp_path / 'absent.jsonl'}\n"


def test_strict_names_file_and_line(prefect_api: str, tmp_path: Path) -> None:
    rollouts = tmp_path / "r.jsonl"
    rollouts.write_bytes(b'{"_ng_task_index": 0, "_ng_rollout_index": 0}\n[1]\n')
    done = run_cli("enrich", str(rollouts), "--capture-dir", str(tmp_path), "--strict", api=prefect_api)
    assert done.returncode == 2 and f"error: {rollouts}:2: not a JSON object (list)" in done.stderr
    assert "Traceback" not in done.stderr  # the traceback is in the run's logs, for the UI


def test_demo_enriches_the_bundled_sample_from_any_folder(prefect_api: str, tmp_path: Path) -> None:
    out = tmp_path / "elsewhere" / "demo.jsonl"
    done = run_cli("demo", "--output", str(out), "--json", api=prefect_api, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["stats"]["rollouts"] == 10
    assert len(out.read_bytes().splitlines()) == len((SAMPLE / "rollouts.jsonl").read_bytes().splitlines())


def test_enrich_runs_prints_each_runs_evidence(prefect_api: str, tmp_path: Path) -> None:
    from .test_evidence_wiring import write_run

    runs = tmp_path / "runs"
    write_run(runs / "bad", poor=True)
    (runs / "bad" / "_SUCCESS").touch()
    done = run_cli("enrich-runs", str(runs), "--max-failed-share", "0.05", api=prefect_api)
    assert done.returncode == 0, done.stderr
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("bad ")]
    cells = re.split(r"\s{2,}", line.strip())
    assert cells[:4] == ["bad", "enriched (Completed with failed calls)", "22", "100"]
    assert cells[4].startswith("10 (upstream_error 6, rate_limit 2")
    assert cells[5:] == ["13.6%", "500 / 900 / 990", "50 / 90 / 99", "1"]

    write_run(runs / "again", poor=True)
    (runs / "again" / "_SUCCESS").touch()
    dumped = json.loads(run_cli("enrich-runs", str(runs), "--json", api=prefect_api).stdout)
    evidence = dumped["outcomes"]["again"]["evidence"]
    assert evidence["failed_calls"] == 10 and evidence["calls_by_error_category"]["rate_limit"] == 2
    assert evidence["ttft_ms"] == {"p50": 50, "p90": 90, "p99": 99}
    assert evidence["orphan_examples"] == ["24-1"]


HOSTILE_MODEL = "gpt\x1b]0;pwned\x07\x1b[2J\x1b[31m[red]x"
"""A model name an upstream answered with: a window title (OSC), clear screen, a colour, rich markup."""


def test_names_from_captures_reach_the_terminal_escaped(prefect_api: str, tmp_path: Path) -> None:
    """The model name from ``response.model``, in enrich's summary table (piped and at a terminal,
    with its progress bar) and in ``inspect``: shown as the characters it holds, never acting on
    the terminal; the failed-call line around it still there."""
    from rollout_capture import CaptureStore

    captures = tmp_path / "caps"
    store = CaptureStore(captures)
    store.record(
        "0-0",
        {
            "model_call_id": "a",
            "dialect": "chat",
            "status_code": 200,
            "response": {"model": HOSTILE_MODEL, "usage": {"prompt_tokens": 3}},
        },
    )
    store.record(
        "0-0",
        {"model_call_id": "b", "dialect": "chat", "status_code": 500, "request": {"model": HOSTILE_MODEL}},
    )
    rollouts = tmp_path / "r.jsonl"
    rollouts.write_text('{"_ng_task_index": 0, "_ng_rollout_index": 0}\n')
    args = ("enrich", str(rollouts), "--capture-dir", str(captures), "--output", str(tmp_path / "o.jsonl"))
    escaped = "gpt\\x1b]0;pwned\\x07\\x1b[2J\\x1b[31m[red]x"
    piped = run_cli(*args, api=prefect_api)
    assert piped.returncode == 0, piped.stderr
    assert "\x1b" not in piped.stdout + piped.stderr and f"model {escaped}" in piped.stdout, piped.stdout
    assert "failed calls" in piped.stdout
    code, text = run_at_terminal(*args, env=cli_env(prefect_api, COLUMNS="200"))
    assert code == 0, text[-2000:]
    assert "\x1b]0;pwned" not in text and "\x1b[2J" not in text and "pwned" in text
    shown = run_cli("inspect", "0-0", "-c", str(captures), api=prefect_api)
    assert shown.returncode == 0 and "\x1b" not in shown.stdout and escaped in shown.stdout, shown.stdout


def test_a_line_break_in_a_recorded_name_never_splits_enrichs_summary_log_line(
    prefect_api: str, tmp_path: Path
) -> None:
    """An error category recorded with a newline and a carriage return: the summary log line (a
    WARNING: every call failed) stays one line, the category shown escaped, no forged line after it."""
    from rollout_capture import CaptureStore

    captures = tmp_path / "caps"
    CaptureStore(captures).record(
        "0-0",
        {"model_call_id": "a", "dialect": "chat", "status_code": 500, "error_category": "boom\nINJECTED\rX"},
    )
    rollouts = tmp_path / "r.jsonl"
    rollouts.write_text('{"_ng_task_index": 0, "_ng_rollout_index": 0}\n')
    done = run_cli(
        "enrich", str(rollouts), "--capture-dir", str(captures), "--output", str(tmp_path / "o.jsonl"),
        "--max-failed-share", "0.5", api=prefect_api,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (summary,) = [line for line in done.stderr.splitlines() if "enriched 1 rollout(s)" in line]
    assert "(1 failed: boom\\nINJECTED\\rX 1" in summary, summary
    assert not [
        line for line in (done.stdout + done.stderr).splitlines() if line.startswith(("INJECTED", "X"))
    ]
    assert "\r" not in done.stderr


def test_a_flow_runs_logs_reach_a_workers_terminal_escaped(tmp_path: Path) -> None:
    """A flow run's process (a worker's or serve's child) prints its logs to their terminal: once
    a flow has started (``show_core_logs``), a log line carrying a record's text is escaped there."""
    import subprocess
    import sys

    script = (
        "import logging\n"
        "import prefect\n"
        "from rollout_capture.flows.report import show_core_logs\n"
        "show_core_logs()\n"
        "logger = logging.getLogger('prefect.rollout_capture_test')\n"
        f"logger.warning('run r1 failed: model %s', {HOSTILE_MODEL!r})\n"
    )
    env = cli_env(None, PREFECT_HOME=str(tmp_path / "home"), PREFECT_LOGGING_LEVEL="INFO")
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "run r1 failed: model gpt\\x1b]0;pwned\\x07" in done.stderr, done.stderr
    assert "\x1b]0;" not in done.stderr and "\x1b[2J" not in done.stderr
