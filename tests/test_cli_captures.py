"""``clear``, ``wait`` and ``inspect`` (``cli/commands/captures.py``), as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson

from rollout_capture import CaptureStore

from .support.cli import ROW, run_cli


def test_wait_and_inspect(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path)
    store.record("4-2", ROW)
    store.record("4-2", {**ROW, "model_call_id": "d", "status_code": 429, "error_category": "rate_limit"})
    assert run_cli("wait", "4-2", "--capture-dir", str(tmp_path), "--timeout", "5").returncode == 0
    with store.claim("4-2"):
        held = run_cli("wait", "4-2", "--capture-dir", str(tmp_path), "--timeout", "0.2")
    assert held.returncode == 1 and "still claimed" in held.stderr
    shown = run_cli("inspect", "4-2", "--capture-dir", str(tmp_path))
    assert shown.returncode == 0, shown.stderr
    rows = [line.split() for line in shown.stdout.splitlines()]
    assert rows[0][:4] == ["#", "model", "dialect", "status"]
    assert rows[2][:4] == ["1", "m", "chat", "429"] and rows[2][-1] == "rate_limit"
    assert run_cli("inspect", "../x", "--capture-dir", str(tmp_path)).returncode == 2


def test_a_rollout_or_a_root_with_no_capture_names_the_likely_causes(tmp_path: Path) -> None:
    """Never zero in silence (issue 45): a producer that saw no rollout prefix, or wrote elsewhere,
    leaves nothing; inspect says what to check, and so does a capture dir that is not there."""
    store = CaptureStore(tmp_path)
    store.record("4-2", ROW)
    shown = run_cli("inspect", "4-3", "--capture-dir", str(tmp_path))
    assert shown.returncode == 0, shown.stderr
    assert "gap: model_call_capture_no_records" in shown.stdout
    assert "observability_enabled" in shown.stdout and "writes elsewhere" in shown.stdout
    missing = run_cli("inspect", "4-2", "--capture-dir", str(tmp_path / "nowhere"))
    assert missing.returncode == 2
    assert "holds no capture: the producer writes elsewhere" in missing.stderr
    assert "nemo-gym" in missing.stderr


def test_clear(prefect_api: str, tmp_path: Path) -> None:
    store = CaptureStore(tmp_path / "caps")
    store.record("0-0", ROW)
    rollouts = tmp_path / "r.jsonl"
    rollouts.write_bytes(orjson.dumps({"_ng_task_index": 0, "_ng_rollout_index": 0}) + b"\n")
    done = run_cli("clear", str(rollouts), "--capture-dir", str(tmp_path / "caps"), api=prefect_api)
    assert done.returncode == 0 and "cleared captures of 1 rollout id(s)" in done.stdout
    assert not store.has_any("0-0")


def _floats(value: Any) -> list[float]:
    if isinstance(value, float):
        return [value]
    if isinstance(value, dict):
        return [f for item in value.values() for f in _floats(item)]
    if isinstance(value, list):
        return [f for item in value for f in _floats(item)]
    return []


def test_json_numbers_are_rounded(tmp_path: Path) -> None:
    """A sum of latencies is printed 164.547, not 164.54699999999997."""
    store = CaptureStore(tmp_path / "caps")
    for latency in (0.1, 0.2, 164.247):
        store.record("1-0", {**ROW, "model_call_id": f"c{latency}", "latency_ms": latency})
    shown = json.loads(run_cli("inspect", "1-0", "--capture-dir", str(tmp_path / "caps"), "--json").stdout)
    assert shown["metrics"]["latency_total_ms"] == 164.547
    assert all(round(f, 3) == f for f in _floats(shown))


def test_allow_empty_lets_clear_wait_and_inspect_take_a_missing_dir(prefect_api: str, tmp_path: Path) -> None:
    rollouts = tmp_path / "r.jsonl"
    rollouts.write_bytes(b'{"_ng_task_index": 0, "_ng_rollout_index": 0}\n')
    missing = str(tmp_path / "later")
    assert run_cli("clear", str(rollouts), "-c", missing, "--allow-empty", api=prefect_api).returncode == 0
    assert run_cli("wait", "0-0", "-c", missing, "--allow-empty").returncode == 0
    shown = run_cli("inspect", "0-0", "-c", missing, "--allow-empty", "--json")
    assert (
        shown.returncode == 0
        and json.loads(shown.stdout)["gaps"][0]["code"] == "model_call_capture_no_records"
    )
