"""Every object store users write captures to, on a real server of its kind the tests start.

moto (S3), fake-gcs-server (GCS) and Azurite (Azure Blob): two proxy processes x 30 calls into one
rollout give 60 of 60, a lease race has one winner, and a scheduled enrichment of the run there
writes what the same captures give on a local disk. ``rclone serve s3`` (an S3-compatible server
that overwrites on ``PutObject`` with ``If-None-Match: *``): both proxies refuse at startup (exit 2
naming the missing put-if-absent), ``enrich-runs`` refuses to take a lease, and reads still work.
A SAS token in an Azure URL is refused by every command, on no stream, in no blob name or record.
"""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from rollout_capture import CaptureStore
from rollout_capture.backends import UnsafeStoreError, open_backend
from rollout_capture.flows import enrich_completed_runs
from rollout_capture.run_folders import RunsRoot

from .conftest import ROOT
from .support.runs_helpers import make_run
from .support.spawned import take_lease
from .support.stores import Store, stop_process

WRITABLE = ["s3", "gcs", "azure"]
CALLS = 30  # per proxy
ROLLOUT = {"_ng_task_index": 0, "_ng_rollout_index": 0}


def cli(*args: str, store: Store) -> list[str]:
    """``rollout-capture ARGS`` as a process, with what reaching the store takes."""
    options = json.dumps(store.storage_options) if store.storage_options else None
    return [
        sys.executable,
        "-m",
        "rollout_capture.cli",
        *args,
        *(["--storage-options", options] if options else []),
    ]


class ProxyProcess:
    """A ``rollout-capture proxy`` process writing to a store; started without waiting for it."""

    def __init__(self, upstream: str, store: Store, captures: str) -> None:
        self.proc = subprocess.Popen(
            cli("proxy", "--upstream", upstream, "--capture-dir", captures, "--port", "0", "--log-level",
                "warning", store=store),
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=store.process_environment(),
        )  # fmt: skip

    def url(self) -> str:
        """Where it serves, once it says so (the line it prints after binding; a library's warning
        may come first); fails with what it printed if it exits instead."""
        assert self.proc.stderr is not None
        said = []
        for line in self.proc.stderr:
            if " on http://" in line:
                threading.Thread(target=lambda: [None for _ in self.proc.stderr or ()], daemon=True).start()
                return line.split(" on ", 1)[1].split(" ", 1)[0]
            said.append(line)
        raise AssertionError(f"the proxy exited ({self.proc.wait()}) without serving: {''.join(said)}")

    def stop(self) -> None:
        stop_process(self.proc, grace_s=30)


def call(base: str, n: int) -> int:
    body = {"model": "scripted", "messages": [{"role": "user", "content": f"call {n}"}]}
    with httpx.Client(base_url=base, timeout=60) as client:
        return client.post("/ng-rollout/0-0/v1/chat/completions", json=body).status_code


def enriched(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


@pytest.mark.parametrize("store", WRITABLE, indirect=True)
@pytest.mark.usefixtures("prefect_api")
def test_two_proxies_capture_every_call_and_the_run_enriches_as_on_a_local_disk(
    store: Store, scripted_upstream: tuple[str, Any], tmp_path: Path
) -> None:
    captures = store.url("runs/r1/captures")
    proxies = [ProxyProcess(scripted_upstream[0], store, captures) for _ in range(2)]  # starting together
    try:
        urls = [proxy.url() for proxy in proxies]
        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(call, [urls[n % 2] for n in range(2 * CALLS)], range(2 * CALLS)))
    finally:
        for proxy in proxies:
            proxy.stop()
    assert statuses == [200] * 2 * CALLS  # every row acknowledged as durable...
    rows = CaptureStore(captures, storage_options=store.storage_options).read("0-0")
    assert len({row["model_call_id"] for row in rows}) == len(rows) == 2 * CALLS  # ...and every one there

    fs = store.fs()
    fs.pipe(
        {
            f"{store.bucket}/runs/r1/rollouts.jsonl": orjson.dumps(ROLLOUT) + b"\n",
            f"{store.bucket}/runs/r1/_SUCCESS": b"",
        }
    )
    local = tmp_path / "runs" / "r1"
    store.download("runs/r1", local)  # the same captures, on a local disk
    on_store = enrich_completed_runs(store.url("runs"), storage_options=store.storage_options or None)
    on_disk = enrich_completed_runs(str(tmp_path / "runs"))
    assert on_store.enriched == on_disk.enriched == ["r1"]
    assert fs.exists(f"{store.bucket}/runs/r1/_ENRICHED")
    assert not [name for name in fs.ls(f"{store.bucket}/runs/r1", detail=False) if "_ENRICHING" in name]
    store.download("runs/r1/rollouts.enriched.jsonl", tmp_path / "from-store.jsonl")
    (record,) = enriched(tmp_path / "from-store.jsonl")
    assert record["ng_model_call_capture"]["metrics"]["num_calls"] == 2 * CALLS
    assert enriched(tmp_path / "from-store.jsonl") == enriched(local / "rollouts.enriched.jsonl")


@pytest.mark.parametrize("store", WRITABLE, indirect=True)
def test_of_processes_racing_for_a_runs_lease_on_the_store_one_wins(store: Store, tmp_path: Path) -> None:
    store.upload(make_run(tmp_path, "r", finished=True), "runs/r")
    context = multiprocessing.get_context("spawn")
    go, results = context.Event(), context.Queue()
    racers = [
        context.Process(target=take_lease, args=(store.url("runs"), "r", go, results, store.storage_options))
        for _ in range(3)
    ]
    for racer in racers:
        racer.start()  # each proves the store's put-if-absent itself (a process of its own)
    go.set()
    for racer in racers:
        racer.join()  # each exits once it has put its answer (the queue is flushed before it exits)
    assert [racer.exitcode for racer in racers] == [0, 0, 0]
    assert sorted(results.get_nowait() for _ in racers) == [False, False, True]


# ---------------------------------------------------------------------- a store that overwrites


@pytest.mark.parametrize("store", ["rclone"], indirect=True)
def test_where_a_second_create_overwrites_both_proxies_refuse_at_startup(
    store: Store, scripted_upstream: tuple[str, Any]
) -> None:
    proxies = [ProxyProcess(scripted_upstream[0], store, store.url("caps")) for _ in range(2)]
    outcomes = [proxy.proc.communicate(timeout=120) for proxy in proxies]
    for proxy, (_, stderr) in zip(proxies, outcomes, strict=True):
        assert proxy.proc.returncode == 2, stderr
        assert " on http://" not in stderr  # it never bound a port
        (error,) = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert f"capture store {store.url('caps')} cannot be written" in error
        assert f"(endpoint {store.endpoint})" in error and "PutObject with If-None-Match: *" in error
        assert "has no put-if-absent" in error and "write to AWS S3, MinIO" in error
    assert store.fs().find(store.bucket) == []  # the probes removed, nothing else written


@pytest.mark.parametrize("store", ["rclone"], indirect=True)
def test_where_a_second_create_overwrites_serve_refuses_before_serving(
    store: Store, prefect_api: str
) -> None:
    """``serve`` takes leases and writes ``_ENRICHED`` as ``enrich-runs`` does: refused (exit 2)
    before anything is registered or served, the probe removed."""
    refused = subprocess.run(
        cli(
            "serve",
            "--runs-root",
            store.url("runs"),
            "--name",
            f"refused-{uuid.uuid4().hex[:8]}",
            store=store,
        ),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**store.process_environment(), "PREFECT_API_URL": prefect_api},
        timeout=120,  # serving would go on until stopped: a refusal exits at once
    )
    assert refused.returncode == 2, refused.stderr
    assert "has no put-if-absent" in refused.stderr and "PutObject with If-None-Match: *" in refused.stderr
    assert store.fs().find(store.bucket) == []


@pytest.mark.parametrize("store", ["rclone"], indirect=True)
@pytest.mark.usefixtures("prefect_api")
def test_where_a_second_create_overwrites_no_lease_is_taken_and_reads_still_work(
    store: Store, tmp_path: Path
) -> None:
    run = make_run(tmp_path / "local", "r", finished=True)
    store.upload(run, "runs/r")  # plain PUTs: what copying a run there sends

    refused = subprocess.run(
        cli("enrich-runs", store.url("runs"), store=store),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert refused.returncode == 2, refused.stderr
    assert "has no put-if-absent" in refused.stderr and "PutObject with If-None-Match: *" in refused.stderr
    with pytest.raises(UnsafeStoreError, match="accepted a second create of one object"):
        enrich_completed_runs(store.url("runs"), storage_options=store.storage_options)
    runs = RunsRoot(store.url("runs"), store.storage_options)
    (found,) = runs.runs()  # reading the runs root works
    with pytest.raises(UnsafeStoreError):
        runs.take(found)
    assert sorted(
        name.rsplit("/", 1)[1] for name in store.fs().ls(f"{store.bucket}/runs/r", detail=False)
    ) == [
        "_SUCCESS",
        "captures",
        "rollouts.jsonl",
    ]  # no lease, no _ENRICHED, no output

    on_store = CaptureStore(store.url("runs/r/captures"), storage_options=store.storage_options)
    on_disk = CaptureStore(run / "captures")
    for rollout_id in ("0-0", "1-0", "2-0"):
        assert on_store.read(rollout_id) == on_disk.read(rollout_id)
    backend = open_backend(store.url("runs/r/captures"), store.storage_options)
    with pytest.raises(UnsafeStoreError):
        backend.create(backend.path("x.json"), b"{}")
    assert not backend.exists(backend.path("x.json"))


# ---------------------------------------------------------------------- a SAS token in a URL

SAS_SIGNATURE = "SASsignatureHunter2%3D"
SAS = f"sv=2021-08-06&ss=b&srt=co&sp=rwdlac&se=2099-01-01T00:00:00Z&sig={SAS_SIGNATURE}"


@pytest.mark.parametrize("store", ["azure"], indirect=True)
def test_a_sas_token_in_a_url_is_refused_never_echoed_written_or_recorded(
    store: Store, tmp_path: Path, prefect_api: str, scripted_upstream: tuple[str, Any]
) -> None:
    """Azure's SAS token (``?sv=...&sig=...``) is a credential as ``X-Amz-Signature`` is: every
    command refuses a URL carrying one (exit 2, the scheme and container named, the token on no
    stream), before a blob is written, a flow run recorded or a deployment registered."""
    run = make_run(tmp_path, "r", finished=True)
    store.upload(run / "captures", "caps")
    before = sorted(store.fs().find(store.bucket))
    rollouts = str(run / "rollouts.jsonl")
    sas, output = f"{store.url('caps')}?{SAS}", f"{store.url('out/e.jsonl')}?{SAS}"
    commands = [
        ["inspect", "0-0", "--capture-dir", sas],
        ["inspect", "0-0", "--capture-dir", f"abfs://{store.bucket}/caps?{SAS}"],
        ["enrich", rollouts, "--capture-dir", store.url("caps"), "--output", output],
        ["enrich", rollouts, "--capture-dir", sas, "--output", str(tmp_path / "e.jsonl")],
        ["enrich-runs", f"{store.url('runs')}?{SAS}"],
        ["deploy", "--runs-root", f"{store.url('runs')}?{SAS}", "--name", f"sas-{uuid.uuid4().hex[:8]}"],
        ["proxy", "--upstream", scripted_upstream[0], "--capture-dir", sas, "--port", "0"],
    ]
    environment = {**store.process_environment(), "PREFECT_API_URL": prefect_api}
    wrong = []
    for command in commands:
        done = subprocess.run(
            cli(*command, store=store), capture_output=True, text=True, cwd=ROOT, env=environment, timeout=120
        )
        shown = done.stdout + done.stderr
        refused = "credentials in the URL are not allowed" in shown and f"://{store.bucket})" in shown
        if done.returncode != 2 or SAS_SIGNATURE in shown or "sig=" in shown or not refused:
            wrong.append((command[0], done.returncode, shown[-600:]))
    assert wrong == []
    assert sorted(store.fs().find(store.bucket)) == before  # no blob written, none named with the token
    for what in ("flow_runs", "deployments"):
        recorded = httpx.post(f"{prefect_api}/{what}/filter", json={"limit": 200}, timeout=60)
        assert recorded.status_code == 200 and SAS_SIGNATURE not in recorded.text


@pytest.mark.parametrize("store", ["gcs"], indirect=True)
def test_a_journal_run_is_read_once_and_as_on_a_local_disk(store: Store, tmp_path: Path) -> None:
    """Issue 48's read plan on another store than S3 (its own client, gcsfs): one listing and one
    GET a commit for an enrichment in batches, none answered 404, the bytes a local copy gives."""
    from .support.fault_proxy import FaultProxy
    from .support.journal_runs import enriched, journal_run

    lines = journal_run(CaptureStore(store.url("caps"), storage_options=store.storage_options), 40, 2)
    commits = len(store.fs().find(f"{store.bucket}/caps/_journal"))
    host, port = store.endpoint.removeprefix("http://").split(":")
    proxy = FaultProxy(host, int(port))
    try:
        via = CaptureStore(store.url("caps"), storage_options={"endpoint_url": proxy.endpoint})
        out = enriched(lines, via, "job")
        assert proxy.reset_counts() == {"LIST": 1, "GET": commits}
        assert set(proxy.reset_answers()["statuses"]) == {200}
    finally:
        proxy.close()
    store.download("caps", tmp_path / "copy")
    assert out == enriched(lines, CaptureStore(str(tmp_path / "copy")), "local")
