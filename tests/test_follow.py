"""Following a run while it runs, end to end on a real Prefect API (and moto's S3): the end equal
to post-run enrichment byte for byte, a late row enriched again, the evidence so far shown and
judged mid-run, kills at seeded points and a restart, two followers racing, Ctrl-C, and a
deployment that follows a run from its ``start``."""

from __future__ import annotations

import multiprocessing
import os
import random
import re
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

from examples.samples import capture_rows, corpus_records
from rollout_capture import CaptureStore
from rollout_capture.flows.events import GAPS_EXCEEDED, RESOURCE_PREFIX
from rollout_capture.live_output import LiveParts
from rollout_capture.rollout_parts import PartsWriter
from rollout_capture.run_folders import ENRICHED, LIVE, OUTPUT, STARTED, SUCCESS, RunsRoot, run_folder

from .conftest import S3, Clock, wait_for
from .support.cli import CLI, cli_env, run_cli, start_worker
from .support.prefect_api import artifacts, wait_for_events
from .support.spawned import KILL_POINTS, follow_reporting, follow_until_killed

REPORT = "rollouts.enriched.report.html"


class Run:
    """A run folder being written as a harness writes it: on a local disk (its rollouts file
    appended) or on S3 (its rollouts as parts, its captures in the journal layout)."""

    def __init__(
        self, tmp_path: Path, s3: S3 | None, records: list[dict[str, Any]], name: str = "r1"
    ) -> None:
        self.s3 = s3
        self.records = records
        self.root = s3.url("runs") if s3 is not None else str(tmp_path / "runs")
        self.url = f"{self.root}/{name}"
        self.options: dict[str, Any] | None = s3.storage_options if s3 is not None else None
        if s3 is None:
            (tmp_path / "runs" / name / "captures").mkdir(parents=True)
            self.store = CaptureStore(f"{self.url}/captures")
        else:
            self.store = CaptureStore(f"{self.url}/captures", storage_options=self.options, layout="journal")
            self.parts = PartsWriter(self.url, self.options)
        self.put(STARTED, b"")
        self.landed = 0

    def fs(self) -> Any:
        from rollout_capture.filesystem import open_filesystem

        return open_filesystem(self.url, self.options)

    def put(self, name: str, data: bytes) -> None:
        fs, path = self.fs()
        fs.makedirs(path, exist_ok=True)
        fs.pipe_file(f"{path}/{name}", data)

    def read(self, name: str) -> bytes:
        fs, path = self.fs()
        return bytes(fs.cat_file(f"{path}/{name}"))

    def remove(self, *names: str) -> None:
        fs, path = self.fs()
        for name in names:
            fs.rm_file(f"{path}/{name}")

    def land(self, count: int, *, captured: Any = lambda index: True) -> None:
        """The next ``count`` records finish: their calls captured (unless ``captured`` says not),
        then their lines land."""
        lines = []
        for index in range(self.landed, self.landed + count):
            record = {
                **self.records[index % len(self.records)],
                "_ng_task_index": index,
                "_ng_rollout_index": 0,
            }
            if captured(index):
                for row in capture_rows(
                    record, f"{index}-0", dialect=("responses", "chat", "messages")[index % 3]
                ):
                    self.store.record(f"{index}-0", row)
            lines.append(orjson.dumps(record))
        self.landed += count
        if self.s3 is not None:
            self.parts.append(lines)
        else:
            with open(f"{self.url}/rollouts.jsonl", "ab") as handle:
                handle.write(b"".join(line + b"\n" for line in lines))

    def live(self) -> list[bytes]:
        """The live output's lines as a reader sees them now."""
        if self.s3 is None:
            path = Path(self.url) / LIVE
            return path.read_bytes().splitlines() if path.exists() else []
        from rollout_capture.backends import open_backend

        return list(LiveParts(open_backend(self.url, self.options), self.url)._parts(self._live_firsts()))

    def _live_firsts(self) -> list[int]:
        fs, path = self.fs()
        try:
            names = fs.ls(f"{path}/rollouts.enriched.live", detail=False)
        except FileNotFoundError:
            return []
        return sorted(int(name.rsplit("/", 1)[-1][:12]) for name in names)


@pytest.fixture(scope="module")
def records(corpus_dir: Path) -> list[dict[str, Any]]:
    return corpus_records(corpus_dir)[:30]


def _stamp_free(report: bytes) -> bytes:
    """The report less the minute it was generated (two enrichments of one run differ there alone)."""
    return re.sub(rb"generated \d{4}-\d\d-\d\d \d\d:\d\d UTC", b"generated -", report)


def _marker(body: bytes) -> dict[str, Any]:
    """``_ENRICHED`` less what differs between any two enrichments: how long it took, and who."""
    marker = orjson.loads(body)
    return {key: value for key, value in marker.items() if key not in ("seconds", "enriched_by")}


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_followed_run_ends_as_post_run_enrichment_ends_it_byte_for_byte(
    prefect_api: str, tmp_path: Path, records: list[dict[str, Any]], request: pytest.FixtureRequest, kind: str
) -> None:
    """Records land while the run is followed; one record gets a row after it was enriched live (a
    late row); every third record has no capture, so the gap share crosses ``max_gap_share``
    mid-run. The gaps-exceeded event is stored before the run finishes; the flow run's live
    artifacts were updated in place; the late row is in the published line (not the live one);
    and the published output, report and ``_ENRICHED`` are what post-run enrichment of the
    finished run gives."""
    from rollout_capture.flows import enrich_completed_runs
    from rollout_capture.flows.follow import follow_run

    run = Run(tmp_path, request.getfixturevalue("s3") if kind == "s3" else None, records)
    done: dict[str, Any] = {}

    def follow() -> None:
        try:
            done["state"] = follow_run(
                run.url, max_gap_share=0.2, storage_options=run.options, return_state=True
            )
        except BaseException as exc:  # the test's thread says it
            done["error"] = exc

    follower = threading.Thread(target=follow)
    follower.start()
    try:
        run.land(6, captured=lambda index: index % 3 != 2)
        wait_for(lambda: len(run.live()) == 6 or "error" in done, 120, "6 lines live")
        before = run.live()[1]
        run.store.record(
            "1-0", {**capture_rows(run.records[1], "1-0", dialect="chat")[0], "model_call_id": "late"}
        )
        for _ in range(4):
            run.land(5, captured=lambda index: index % 3 != 2)
        output = f"{run.url}/{OUTPUT}"
        exceeded = wait_for_events(GAPS_EXCEEDED, RESOURCE_PREFIX + output, 120)
        assert exceeded[0].payload["live"] is True and exceeded[0].payload["rollouts"] >= 20
        assert SUCCESS not in [name.rsplit("/", 1)[-1] for name in run.fs()[0].ls(run.fs()[1], detail=False)]
        run.put(SUCCESS, b"")
    finally:
        follower.join(300)
    assert "error" not in done, done.get("error")
    state = done["state"]
    summary = state.result()
    assert (summary.status, summary.live, summary.late, summary.late_examples) == (
        "published",
        26,
        1,
        ["1-0"],
    )
    assert summary.live_events == [GAPS_EXCEEDED]
    live = run.live()
    assert live[1] == before and b'"late"' not in live[1]  # the live line is as it was enriched...
    published = run.read(OUTPUT).splitlines()
    assert (
        b'"late"' in published[1] and published[:1] + published[2:] == live[:1] + live[2:]
    )  # ...the end is now

    found = {a.key: a for a in artifacts(state.state_details.flow_run_id) if a.key}
    following = [a for key, a in found.items() if key.startswith("following-")]
    assert len(following) == 1 and "26 of 26 line(s) live (finished)" in following[0].data
    assert any(key.startswith("enrichment-summary-") for key in found)  # the end's own, as post-run's

    ended = {name: run.read(name) for name in (OUTPUT, REPORT, ENRICHED)}
    run.remove(OUTPUT, REPORT, ENRICHED)
    again = enrich_completed_runs(run.root, storage_options=run.options)
    assert again.enriched == ["r1"]
    assert run.read(OUTPUT) == ended[OUTPUT]
    assert _stamp_free(run.read(REPORT)) == _stamp_free(ended[REPORT])
    assert _marker(run.read(ENRICHED)) == _marker(ended[ENRICHED])


SEED = 47


@pytest.mark.parametrize("point", KILL_POINTS)
def test_a_follower_killed_at_any_point_is_followed_on_from_what_it_made_durable(
    prefect_api: str, tmp_path: Path, records: list[dict[str, Any]], clock: Clock, point: str
) -> None:
    """A follower in a process of its own is SIGKILLed at a seeded point (its round picked by the
    seed): halfway through writing a round, right after one, between publishing and ``_ENRICHED``,
    between ``_ENRICHED`` and dropping its lease. Once its lease lapses a follower started again
    goes on from its live output: every line live exactly once, in order, the cut one written
    whole; the output published is the live output (no capture changed), ``_ENRICHED`` written once."""
    from rollout_capture.flows.follow import follow_run

    nth = random.Random(f"{SEED}:{point}").randrange(1, 4)  # of the 4 rounds of 3, 3, 3, 1 lines
    run = Run(tmp_path, None, records)
    run.land(10)
    ending = point in ("before-marker", "after-marker")
    if ending:
        run.put(SUCCESS, b"")
    options = {"batch_size": 3, "lease_s": 60.0}
    child = multiprocessing.get_context("spawn").Process(
        target=follow_until_killed, args=(prefect_api, run.url, point, nth, options)
    )
    child.start()
    child.join(300)
    assert child.exitcode == -signal.SIGKILL, f"{point} #{nth}: exited {child.exitcode}"
    if not ending:
        run.put(SUCCESS, b"")
    marker = run.read(ENRICHED) if point == "after-marker" else None

    state, _ = run_folder(run.url)
    lease = RunsRoot(run.root).current_lease(state)
    assert lease is not None and f":{child.pid}:" in lease.owner  # the dead follower's, still there
    clock.set(lease.expires_at)  # the instant it lapses
    summary = follow_run(run.url, **options)

    live = run.live()
    lines = Path(run.url, "rollouts.jsonl").read_bytes().splitlines()
    assert len(live) == len(lines) == 10
    assert all(
        enriched.startswith(line[:-1] + b',"ng_model_call_capture"')
        for line, enriched in zip(lines, live, strict=True)
    )
    assert run.read(OUTPUT).splitlines() == live
    if point == "after-marker":
        assert summary.status == "already_enriched" and run.read(ENRICHED) == marker  # written once
    else:
        assert summary.status == "published"
        whole = 10 if ending else 3 * nth  # lines live once the round it died in had been written
        assert whole - 3 < summary.resumed <= whole if point == "mid-append" else summary.resumed == whole
        assert f":{os.getpid()}:" in orjson.loads(run.read(ENRICHED))["enriched_by"]


def test_two_followers_racing_for_one_run_never_both_write(
    prefect_api: str, tmp_path: Path, records: list[dict[str, Any]]
) -> None:
    """Two followers in processes of their own start at once: one takes the lease and publishes, the
    other says the run is busy and writes nothing; every line is live once."""
    run = Run(tmp_path, None, records)
    run.land(8)
    context = multiprocessing.get_context("spawn")
    go = context.Event()
    reports = [tmp_path / f"racer-{n}.json" for n in range(2)]
    racers = [
        context.Process(
            target=follow_reporting, args=(prefect_api, run.url, go, str(report), {"lease_s": 60.0})
        )
        for report in reports
    ]
    for racer in racers:
        racer.start()
    go.set()
    try:
        wait_for(lambda: any(report.exists() for report in reports), 300, "the follower that lost the race")
        wait_for(lambda: len(run.live()) == 8, 120, "the other to make 8 lines live")
        run.land(4)
        run.put(SUCCESS, b"")
        for racer in racers:
            racer.join(300)
    finally:
        for racer in racers:
            if racer.is_alive():
                racer.kill()
    said = sorted(orjson.loads(report.read_bytes())["status"] for report in reports)
    assert said == ["busy", "published"], [racer.exitcode for racer in racers]
    lines = Path(run.url, "rollouts.jsonl").read_bytes().splitlines()
    live = run.live()
    assert len(live) == 12 and all(
        e.startswith(line[:-1] + b",") for line, e in zip(lines, live, strict=True)
    )
    assert run.read(OUTPUT).splitlines() == live


def test_a_run_that_never_finishes_stops_on_ctrl_c_saying_where_it_stood(
    prefect_api: str, tmp_path: Path, records: list[dict[str, Any]]
) -> None:
    """``rollout-capture follow`` of a run that never finishes: Ctrl-C stops it after the round in
    hand (exit 130), saying how many lines are live and what the next one waits on; its lease is
    given back (a released generation on top), so following again at once goes on from there."""
    run = Run(tmp_path, None, records)
    run.land(5)
    claim = run.store.claim("5-0", "still-running", ttl_s=3600)
    claim.__enter__()
    run.land(2, captured=lambda index: False)  # 5-0 lands while its call is still claimed
    follower = subprocess.Popen(
        [*CLI, "follow", run.url, "--lease-s", "60", "--quiescence-timeout", "600"],
        env=cli_env(prefect_api),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: len(run.live()) == 5 or follower.poll() is not None, 180, "5 lines live")
        follower.send_signal(signal.SIGINT)
        err = follower.communicate(timeout=120)[1]
    finally:
        claim.__exit__(None, None, None)
        if follower.poll() is None:
            follower.kill()
    assert follower.returncode == 130, err[-3000:]
    assert f"stopped following {run.url}: 5 line(s) live in {run.url}/{LIVE}" in err, err[-3000:]
    assert "2 line(s) read but not live yet (waiting on the claims of 5-0)" in err
    assert "following it again goes on from line 6" in err and "Traceback" not in err
    state, _ = run_folder(run.url, needs="started")
    lease = RunsRoot(run.root).current_lease(state)
    assert lease is not None and lease.released and ENRICHED not in os.listdir(run.url)
    run.put(SUCCESS, b"")
    done = run_cli("follow", run.url, "--json", api=prefect_api)
    assert done.returncode == 0, done.stderr[-3000:]
    said = orjson.loads(done.stdout)
    assert (said["status"], said["resumed"], said["live"]) == ("published", 5, 7)


def test_a_started_run_is_followed_by_its_deployment_and_published_once(
    prefect_api: str, tmp_path: Path, records: list[dict[str, Any]]
) -> None:
    """``rollout-capture start`` writes ``_STARTED`` and emits the event; the root's follower
    deployment (its trigger handing the run over) follows it on a real worker: its records are live
    while it runs, and once ``finish`` says it is done it is published, ``_ENRICHED`` once (the
    scheduled deployment, triggered by ``finish`` too, finds the run taken)."""
    from prefect.client.orchestration import get_client

    from rollout_capture.deployments.register import register
    from rollout_capture.run_events import RUN_STARTED, post_run_event

    root = tmp_path / "runs"
    root.mkdir()
    pool = "rollout-capture-follow"
    register(str(root), pool=pool, cron="0 0 1 1 *", parameters={}, name="on-start", automation=False)
    worker = start_worker(pool, prefect_api, tmp_path)
    run_url = str(root / "r1")
    try:
        started = run_cli("start", run_url, api=prefect_api)
        assert started.returncode == 0 and "the server was told" in started.stdout, started.stderr
        run = Run(tmp_path, None, records)
        run.land(4)

        def followed() -> bool:
            """The triggers service loads a new deployment's trigger when it does: an event before
            that goes unseen, so the run's start is told again until a follower has it."""
            try:
                return wait_for(lambda: len(run.live()) == 4, 30, "4 lines live", poll_s=0.2)
            except AssertionError:
                assert post_run_event(prefect_api, run_url, RUN_STARTED)
                return False

        wait_for(followed, 300, "the deployment's follower to make 4 lines live", poll_s=0)
        run.land(2)
        finished = run_cli("finish", run_url, api=prefect_api)
        assert finished.returncode == 0, finished.stderr
        wait_for(lambda: (root / "r1" / ENRICHED).exists(), 240, "the run to be published", poll_s=0.2)
    finally:
        worker.send_signal(signal.SIGINT)
        output = worker.communicate(timeout=60)[0]
        with get_client(sync_client=True) as client:
            for deployment in client.read_deployments():
                if deployment.name.startswith("on-start"):
                    client.delete_deployment(deployment.id)
    assert run.read(OUTPUT).splitlines() == run.live() and len(run.live()) == 6, output[-4000:]
