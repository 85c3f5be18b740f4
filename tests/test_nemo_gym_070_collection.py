"""C: NeMo Gym 0.7.0's own rollout collection, end to end, re-enriched by ours (issue 34).

Its ``simple_agent``, its vLLM model server in front of the scripted upstream, its example
resources server, with model-call capture on, run as NeMo Gym runs them
(tests/support/nemo_gym_side.py ``collect``). Its rollouts come back with
``ng_model_call_capture``; without it, ``rollout-capture enrich`` (run from the same Python 3.13
environment, installed beside nemo-gym as a wheel) must attach what NeMo Gym's merge attaches to
the same records once its servers have stopped, and every call NeMo Gym attached during its
collection must be one of ours, equal (its collection may merge before a row has landed: see the
test). Run by
``make test-nemo-gym``, on an xdist worker of its own beside tests/test_nemo_gym_070.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from .support.scripted_upstream import ScriptedUpstream
from .support.servers import ThreadedServer
from .test_nemo_gym_070 import NG_PYTHON, SIDE, Tally, _note_differences, compare, print_counts

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(1800),  # NeMo Gym's servers and imports start slowly on a busy machine
    pytest.mark.skipif(not NG_PYTHON, reason="NeMo Gym 0.7.0's own tier: run by `make test-nemo-gym`"),
]

WEATHER_TOOL = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": ""}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
    "type": "function",
    "description": "",
}


def weather_rows() -> list[dict[str, Any]]:
    """Rows as NeMo Gym's example weather dataset holds them; the last one's prompt is past the
    model's context (the scripted upstream answers 400 as vLLM does, NeMo Gym's server itself)."""
    asks = ["what's it like in sf?", "going out in sf tn", "humidity in sf", "scripted-context-overflow " * 3]
    return [
        {
            "responses_create_params": {
                "input": [
                    {"content": "You are a helpful personal assistant.", "role": "developer"},
                    {"content": ask, "role": "user"},
                ],
                "tools": [WEATHER_TOOL],
            }
        }
        for ask in asks
    ]


def test_c_nemo_gyms_rollout_collection_re_enriched_by_ours(tmp_path: Path) -> None:
    assert NG_PYTHON is not None
    capture_dir, work = tmp_path / "captures", tmp_path / "work"
    capture_dir.mkdir()
    work.mkdir()
    given, collected = tmp_path / "rows.jsonl", tmp_path / "rollouts.jsonl"
    given.write_text("".join(json.dumps(row) + "\n" for row in weather_rows()))
    upstream = ThreadedServer(ScriptedUpstream())
    try:
        command = [
            NG_PYTHON,
            str(SIDE),
            "collect",
            "--upstream",
            upstream.url,
            "--capture-dir",
            str(capture_dir),
        ]
        command += ["--workdir", str(work), "--input", str(given), "--output", str(collected)]
        subprocess.run(command, check=True, timeout=1200, cwd=tmp_path, stdout=subprocess.DEVNULL)
    finally:
        upstream.stop()
    gym_records = [json.loads(line) for line in collected.read_text().splitlines()]
    assert len(gym_records) == 2 * len(weather_rows())  # each row twice (num_repeats)
    attached = [record.pop("ng_model_call_capture") for record in gym_records]
    stripped, enriched = tmp_path / "stripped.jsonl", tmp_path / "stripped.enriched.jsonl"
    stripped.write_text("".join(json.dumps(r) + "\n" for r in gym_records))
    ours_cli = Path(NG_PYTHON).parent / "rollout-capture"  # installed beside nemo-gym, in its Python
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    env.pop("PREFECT_API_URL", None)
    done = subprocess.run(
        [
            str(ours_cli),
            "enrich",
            str(stripped),
            "--capture-dir",
            str(capture_dir),
            "--output",
            str(enriched),
        ],
        env=env,
        timeout=600,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    ours = [json.loads(line) for line in enriched.read_text().splitlines()]
    # NeMo Gym's own merge of the same records, now that its servers have stopped (every row landed).
    merged = tmp_path / "stripped.nemo-gym.jsonl"
    command = [NG_PYTHON, str(SIDE), "merge", "--records", str(stripped), f"{capture_dir}={merged}"]
    subprocess.run(command, check=True, timeout=900)
    meta, *lines = merged.read_text().splitlines()
    assert json.loads(meta)["nemo_gym"] == "0.7.0"
    theirs = [json.loads(line) for line in lines]
    tally = Tally()
    compare(theirs, ours, tally)
    print_counts("C: NeMo Gym's rollout collection, NeMo Gym's merge vs `rollout-capture enrich`", tally)
    assert tally.differences == [] and tally.equal == tally.calls >= 14
    calls = [call for record in theirs for call in record["ng_model_call_capture"]["calls"]]
    local = [c for c in calls if c["response_source"] == "local"]  # NeMo Gym's own answer, kept
    assert local and {c["local_response_reason"] for c in local} == {"context_length_exceeded"}
    # What NeMo Gym attached during its collection: the same calls, but for rows that had not landed
    # yet. Its model server lets a plain answer's body reach the agent before the row is written
    # (its session middleware, inside the capture, sends the body ahead of the closing message the
    # capture holds back), so its collection may merge a rollout before the row of its last call.
    early = Tally()
    for at_collection, record in zip(attached, ours, strict=True):
        mine = {c["model_call_id"]: c for c in record["ng_model_call_capture"]["calls"]}
        early.records += 1
        for call in at_collection["calls"]:
            early.calls += 1
            found: list[str] = []
            my_call = {key: mine[call["model_call_id"]].get(key, "<missing>") for key in call}
            _note_differences({**call, "call_index": 0}, {**my_call, "call_index": 0}, "call", found)
            early.equal += not found
            early.differences += found
    missing = sum(len(r["ng_model_call_capture"]["calls"]) for r in ours) - early.calls
    print_counts(f"C: what NeMo Gym's collection attached vs ours ({missing} rows not landed yet)", early)
    assert early.differences == [] and early.equal == early.calls
