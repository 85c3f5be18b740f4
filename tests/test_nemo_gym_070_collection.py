"""C and D: NeMo Gym 0.7.0's own rollout collection, end to end, enriched by ours (issues 34, 45).

Its ``simple_agent``, its vLLM model server in front of the scripted upstream, its example
resources server, with model-call capture on, run as NeMo Gym runs them
(tests/support/nemo_gym_side.py ``collect``). Its rollouts come back with
``ng_model_call_capture``; without it, ``rollout-capture enrich`` (run from the same Python 3.13
environment, installed beside nemo-gym as a wheel) must attach what NeMo Gym's merge attaches to
the same records once its servers have stopped, and every call NeMo Gym attached during its
collection must be one of ours, equal (its collection may merge before a row has landed: see the
test). D runs the same collection with rollout-capture's model server (docs/nemo-gym.md)
capturing to S3 and Azure, enriched by ``finish`` + ``enrich-runs``: the whole 0.7.0 record, equal
to the collection with NeMo Gym's own capture. Run by ``make test-nemo-gym``, on an xdist worker
of its own beside tests/test_nemo_gym_070.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .support.nemo_gym_compare import Tally, by_rollout, compare, normalized, note_differences, print_counts
from .support.scripted_upstream import ScriptedUpstream
from .support.servers import ThreadedServer
from .test_nemo_gym_070 import NG_PYTHON, SIDE

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


class Collected:
    """A NeMo Gym collection's records (as its collection wrote them) and where its captures are."""

    def __init__(self, records: Path, capture_dir: Path, seconds: float) -> None:
        self.records = records
        self.capture_dir = capture_dir
        self.seconds = seconds


def collect(
    folder: Path,
    *,
    upstream: str,
    ours: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    output: Path | None = None,
    hold_until_live: Path | None = None,
) -> Collected:
    """NeMo Gym 0.7.0's own collection of the weather rows (each twice) run in ``folder``: with its
    own capture into ``folder/captures``, or with ``ours`` (rollout-capture's model server, these
    capture settings, two uvicorn workers: docs/nemo-gym.md's recipe), ``folder/captures`` then
    the local folder NeMo Gym asks for (it must stay empty). Its rollouts go to ``output`` (default
    ``folder/rollouts.jsonl``); with ``hold_until_live``, its servers stay up after the collection
    until that file (a follower's live output) has a line for each of them."""
    assert NG_PYTHON is not None
    capture_dir, work = folder / "captures", folder / "work"
    capture_dir.mkdir(parents=True)
    work.mkdir()
    given, collected = folder / "rows.jsonl", output or folder / "rollouts.jsonl"
    given.write_text("".join(json.dumps(row) + "\n" for row in weather_rows()))
    command = [NG_PYTHON, str(SIDE), "collect", "--upstream", upstream, "--capture-dir", str(capture_dir)]
    command += ["--workdir", str(work), "--input", str(given), "--output", str(collected)]
    if ours is not None:
        command += ["--ours", json.dumps(ours), "--num-workers", "2"]
    if hold_until_live is not None:
        command += ["--hold-until-live", str(hold_until_live)]
    started = time.monotonic()
    subprocess.run(command, check=True, timeout=1200, cwd=folder, stdout=subprocess.DEVNULL, env=env)
    return Collected(collected, capture_dir, time.monotonic() - started)


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    server = ThreadedServer(ScriptedUpstream())
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def nemo_gyms_own(upstream: str, tmp_path_factory: pytest.TempPathFactory) -> Collected:
    """The scenario collected by NeMo Gym with its own capture (a local folder): what ours must equal."""
    return collect(tmp_path_factory.mktemp("nemo-gym-own"), upstream=upstream)


def _ours_env(api: str, tmp_path: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Our CLI's environment: the session's Prefect API (one server for every command of the
    module's tests, not a temporary one each), a Prefect home of its own, what reaches the store."""
    env = {**os.environ, **(extra or {})}
    env.update(
        {
            "PREFECT_API_URL": api,
            "PREFECT_HOME": str(tmp_path / "prefect"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        }
    )
    return env


def test_c_nemo_gyms_rollout_collection_re_enriched_by_ours(
    nemo_gyms_own: Collected, prefect_api: str, tmp_path: Path
) -> None:
    assert NG_PYTHON is not None
    capture_dir, collected = nemo_gyms_own.capture_dir, nemo_gyms_own.records
    gym_records = [json.loads(line) for line in collected.read_text().splitlines()]
    assert len(gym_records) == 2 * len(weather_rows())  # each row twice (num_repeats)
    attached = [record.pop("ng_model_call_capture") for record in gym_records]
    stripped, enriched = tmp_path / "stripped.jsonl", tmp_path / "stripped.enriched.jsonl"
    stripped.write_text("".join(json.dumps(r) + "\n" for r in gym_records))
    ours_cli = Path(NG_PYTHON).parent / "rollout-capture"  # installed beside nemo-gym, in its Python
    env = _ours_env(prefect_api, tmp_path)
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
            note_differences({**call, "call_index": 0}, {**my_call, "call_index": 0}, "call", found)
            early.equal += not found
            early.differences += found
    missing = sum(len(r["ng_model_call_capture"]["calls"]) for r in ours) - early.calls
    print_counts(f"C: what NeMo Gym's collection attached vs ours ({missing} rows not landed yet)", early)
    assert early.differences == [] and early.equal == early.calls


def _perf_fields(theirs: list[dict[str, Any]], ours: list[dict[str, Any]]) -> tuple[int, int]:
    """``ng_perf`` fields equal, of all (but the collection's own clock, ``total_latency_ms``)."""
    equal = total = 0
    for gym, mine in zip(theirs, ours, strict=True):
        for key in set(gym.get("ng_perf") or {}) | set(mine.get("ng_perf") or {}):
            if key == "total_latency_ms":
                continue
            total += 1
            equal += (gym.get("ng_perf") or {}).get(key, "<missing>") == (mine.get("ng_perf") or {}).get(key)
    return equal, total


def _trajectory_calls(theirs: list[dict[str, Any]], ours: list[dict[str, Any]]) -> tuple[int, int]:
    """``ng_trajectory`` model calls equal (normalized), of NeMo Gym's."""
    equal = total = 0
    for gym, mine in zip(theirs, ours, strict=True):
        gym_calls = normalized(gym)["ng_trajectory"]["model_calls"]
        my_calls = normalized(mine)["ng_trajectory"]["model_calls"]
        total += len(gym_calls)
        equal += sum(a == b for a, b in zip(gym_calls, my_calls, strict=False))
    return equal, total


def _what_nemo_gym_sees(records: Path) -> dict[str, Any]:
    """NeMo Gym's health summary and perf_summary of a records file, the collection's own clock
    (its latency statistics) left out."""
    assert NG_PYTHON is not None
    done = subprocess.run(
        [NG_PYTHON, str(SIDE), "health", "--records", str(records)],
        cwd=records.parent,
        check=True,
        timeout=600,
        capture_output=True,
        text=True,
    )
    seen = json.loads(done.stdout)
    perf = {k: v for k, v in (seen["perf_summary"] or {}).items() if not k.startswith("total_latency_")}
    return {"health": seen["health"], "perf_summary": perf}


def _watch_lines(paths: dict[str, Path], seen: dict[str, list[float]], done: threading.Event) -> None:
    """When each line of each file appeared (the test's own record of landing and readable)."""
    while not done.is_set():
        for name, path in paths.items():
            count = path.read_bytes().count(b"\n") if path.exists() else 0
            seen[name] += [time.monotonic()] * (count - len(seen[name]))
        done.wait(0.05)


def _run(cli: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([cli, *args], env=env, timeout=900, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def _collected_and_followed(
    store: Any, upstream: str, cli: str, env: dict[str, str], tmp_path: Path
) -> tuple[Path, float, str]:
    """The collection's records appended to a run folder on its host, followed live (issue 47)
    while its model server captures to the store: every enriched line readable while the
    collection still runs (its servers stay up until the live output has them all); then
    ``finish``, and the follower publishes. The published output is byte for byte a post-run
    enrichment of the run. Returns the output, the seconds from the collection's end to it, and
    what the follow saw."""
    run, captures = tmp_path / "run", store.url("runs/r1/captures")
    options = ["--storage-options", json.dumps(store.storage_options)]
    _run(cli, "start", str(run), env=env)
    live, rollouts = run / "rollouts.enriched.live.jsonl", run / "rollouts.jsonl"
    follow = [cli, "follow", str(run), "--capture-dir", captures, *options, "--json"]
    follower = subprocess.Popen(follow, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: dict[str, list[float]] = {"landed": [], "live": []}
    done = threading.Event()
    watcher = threading.Thread(target=_watch_lines, args=({"landed": rollouts, "live": live}, seen, done))
    watcher.start()
    try:
        ours = {"capture_dir": captures, "storage_options": store.storage_options}
        collected = collect(
            tmp_path / "collection",
            upstream=upstream,
            ours=ours,
            env=env,
            output=rollouts,
            hold_until_live=live,
        )
        ended = time.monotonic()
        assert list(collected.capture_dir.iterdir()) == []  # NeMo Gym's own folder: nothing in it
        landed = rollouts.read_bytes().count(b"\n")
        assert landed == 8 and live.read_bytes().count(b"\n") == landed  # all live, servers still up
        _run(cli, "finish", str(run), env=env)
        out, err = follower.communicate(timeout=900)
        assert follower.returncode == 0, err
        enriched_after = time.monotonic() - ended
    finally:
        done.set()
        watcher.join()
        if follower.poll() is None:
            follower.kill()
    post_run = tmp_path / "post-run.jsonl"
    _run(
        cli, "enrich", str(rollouts), "--capture-dir", captures, *options, "--output", str(post_run), env=env
    )
    assert (run / "rollouts.enriched.jsonl").read_bytes() == post_run.read_bytes()
    assert (run / "_ENRICHED").exists()
    lived = [json.loads(line) for line in live.read_text().splitlines()]
    assert all(r["ng_trajectory"]["model_calls"] for r in lived)  # the whole record, live too
    waits = sorted(b - a for a, b in zip(seen["landed"], seen["live"], strict=False))
    late = json.loads(out).get("late", 0)
    return post_run, enriched_after, f"followed: landing to readable p50 {waits[4]:.1f} s, late {late}; "


def _collected_and_finished(
    store: Any, upstream: str, cli: str, env: dict[str, str], tmp_path: Path
) -> tuple[Path, float, str]:
    """The collection's records (as NeMo Gym's collection left them: 0 model calls, coverage 0.0)
    put beside the captures as a run folder on the store, then ``finish`` and ``enrich-runs``."""
    run = store.url("runs/r1")
    ours = {"capture_dir": f"{run}/captures", "storage_options": store.storage_options}
    collected = collect(tmp_path / "collection", upstream=upstream, ours=ours, env=env)
    ended = time.monotonic()
    assert list(collected.capture_dir.iterdir()) == []  # NeMo Gym's own folder: nothing in it
    left = [json.loads(line) for line in collected.records.read_text().splitlines()]
    assert left and all(r["ng_trajectory"]["model_calls"] == [] for r in left)  # what the issue saw
    assert all(r["ng_perf"]["token_observability_coverage"] == 0.0 for r in left)
    store.fs().put(str(collected.records), f"{store.bucket}/runs/r1/rollouts.jsonl")
    options = ["--storage-options", json.dumps(store.storage_options)]
    _run(cli, "finish", run, *options, env=env)
    _run(cli, "enrich-runs", store.url("runs"), *options, "--json", env=env)
    enriched_after = time.monotonic() - ended
    output = tmp_path / "rollouts.enriched.jsonl"
    store.fs().get(f"{store.bucket}/runs/r1/rollouts.enriched.jsonl", str(output))
    return output, enriched_after, "finish + enrich-runs; "


@pytest.mark.parametrize(("store", "how"), [("s3", "followed"), ("azure", "finished")], indirect=["store"])
def test_d_nemo_gym_captured_to_an_object_store_gets_its_whole_record(
    store: Any, how: str, upstream: str, nemo_gyms_own: Collected, prefect_api: str, tmp_path: Path
) -> None:
    """D (issue 45): NeMo Gym's own collection whose model server is rollout-capture's (the recipe,
    two uvicorn workers) capturing to an object store; NeMo Gym's own capture folder stays empty.
    On S3 the run is followed live as it is collected (issue 47); on Azure it is enriched after,
    as a user would: the rollouts beside the captures, ``finish``, ``enrich-runs``. Every record
    equals what NeMo Gym's collection with its own local capture wrote for the same scenario (ids
    and the clock aside): ``ng_model_call_capture``, ``ng_trajectory`` (payloads where it keeps
    them) and ``ng_perf``; and NeMo Gym's own health checks and ``perf_summary`` read ours as they
    read theirs."""
    assert NG_PYTHON is not None
    env = _ours_env(prefect_api, tmp_path, store.environment)
    cli = str(Path(NG_PYTHON).parent / "rollout-capture")
    enrich = _collected_and_followed if how == "followed" else _collected_and_finished
    output, enriched_after, said = enrich(store, upstream, cli, env, tmp_path)

    theirs = by_rollout([json.loads(line) for line in nemo_gyms_own.records.read_text().splitlines()])
    mine = by_rollout([json.loads(line) for line in output.read_text().splitlines()])
    tally = Tally()
    compare([normalized(r) for r in theirs], [normalized(r) for r in mine], tally)
    trajectory_equal, trajectory_total = _trajectory_calls(theirs, mine)
    perf_equal, perf_total = _perf_fields(theirs, mine)
    print_counts(
        f"D ({store.kind}, two workers, {said}enriched {enriched_after:.1f} s after the collection's end): "
        f"NeMo Gym's own collection vs ours; trajectory model calls {trajectory_equal}/{trajectory_total}, "
        f"ng_perf fields {perf_equal}/{perf_total}",
        tally,
    )
    assert tally.differences == [] and tally.records == len(theirs) == 8
    assert tally.equal == tally.calls >= 14
    assert trajectory_equal == trajectory_total == tally.calls
    assert perf_equal == perf_total > 0
    enriched_output = tmp_path / "ours.jsonl"  # as a file NeMo Gym's tools read, in rollout order
    enriched_output.write_text("".join(json.dumps(r) + "\n" for r in mine))
    their_output = tmp_path / "theirs.jsonl"
    their_output.write_text("".join(json.dumps(r) + "\n" for r in theirs))
    seen_ours, seen_theirs = _what_nemo_gym_sees(enriched_output), _what_nemo_gym_sees(their_output)
    assert seen_ours == seen_theirs
    assert seen_ours["health"]["run"]["verdicts"]["unobserved"] == 0
