"""Batches on real clusters the tests start as separate processes: a Dask scheduler and two
workers, a Ray head (``ray start --head``), each in a folder other than the flow's.

One cluster of each kind per session. Their workers run in a mount namespace of their own
where one folder, ``blind``, is an empty tmpfs: a path the flow sees with captures in it and
the workers do not, as on a machine where the share is not mounted.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from uuid import UUID

import orjson
import pytest
from prefect.client.schemas.objects import TaskRun

from rollout_capture import CaptureStore
from rollout_capture.flows import enrich_completed_runs, enrich_rollouts
from rollout_capture.flows.enrich_runs import RunsFailed

from .support.prefect_api import running_task_runs, state_history, task_runs
from .test_runners import enrich, eventually, write_run

pytestmark = pytest.mark.usefixtures("prefect_api")

BIN = Path(sys.executable).parent
RUNNERS = ["dask", "ray"]


@dataclass
class Home:
    """Where the clusters live: their working directory and the folder their workers cannot see."""

    base: Path
    elsewhere: Path
    blind: Path
    blinded: bool
    why_not: str = ""

    def command(self, *args: str) -> list[str]:
        """``args`` run in a mount namespace where ``blind`` is an empty tmpfs (when that works here)."""
        if not self.blinded:
            return list(args)
        script = 'mount -t tmpfs tmpfs "$0" && exec "$@"'
        return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(self.blind), *args]

    def spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = (self.base / f"{name}.log").open("wb")
        return subprocess.Popen(
            self.command(*args),
            cwd=self.elsewhere,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@dataclass
class Cluster:
    runner: str
    address: str
    workers: Callable[[], dict[int, str]]
    """The pid of each worker process, with what it runs now ('' when idle)."""
    settle: Callable[[], None]
    """Wait until the cluster is back to full strength (after a worker was killed)."""

    def options(self) -> dict[str, Any]:
        return {"runner": self.runner, f"{self.runner}_address": self.address}


@pytest.fixture(scope="session")
def home(tmp_path_factory: pytest.TempPathFactory) -> Home:
    base = tmp_path_factory.mktemp("clusters")
    (base / "elsewhere").mkdir()
    (base / "blind").mkdir()
    home = Home(base=base, elsewhere=base / "elsewhere", blind=base / "blind", blinded=True)
    probe = subprocess.run(home.command("true"), capture_output=True, text=True)
    if probe.returncode:
        home.blinded, home.why_not = False, f"no tmpfs in a mount namespace here: {probe.stderr.strip()}"
    return home


def stop(process: subprocess.Popen[bytes], grace_s: float = 60) -> None:
    """SIGTERM the process we started (it stops its own children), then its group if it lingers."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(10)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def wait_for(
    what: str, ready: Callable[[], bool], processes: list[subprocess.Popen[bytes]], home: Home
) -> None:
    deadline = time.monotonic() + 180
    while not ready():
        dead = [p for p in processes if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            logs = "\n".join(f.read_text(errors="replace")[-2000:] for f in home.base.glob("*.log"))
            raise RuntimeError(f"{what} did not start:\n{logs}")
        time.sleep(0.2)


@pytest.fixture(scope="module")  # only this file's: stopped with it, not left idle
def dask_cluster(home: Home) -> Iterator[Cluster]:
    """A scheduler and two workers (each under a nanny that restarts it), as ``dask`` CLI processes."""
    from distributed import Client

    scheduler_file = home.base / "scheduler.json"
    dask, common = str(BIN / "dask"), ["--no-dashboard", "--host", "127.0.0.1"]
    at = ["--scheduler-file", str(scheduler_file)]
    scheduler = home.spawn("dask-scheduler", dask, "scheduler", "--port", "0", *at, *common)
    processes = [scheduler]
    try:
        wait_for("the Dask scheduler", scheduler_file.exists, processes, home)
        for index in range(2):
            one = ["--nworkers", "1", "--nthreads", "1", "--name", f"worker-{index}"]
            processes.append(home.spawn(f"dask-worker-{index}", dask, "worker", *at, *one, *common))
        client = Client(scheduler_file=str(scheduler_file), timeout=60)
        try:
            client.wait_for_workers(2, timeout=180)

            def workers() -> dict[int, str]:
                processing = client.processing()
                pids = client.run(os.getpid)
                return {pid: ",".join(map(str, processing.get(a, ()))) for a, pid in pids.items()}

            def settle() -> None:
                client.wait_for_workers(2, timeout=180)

            yield Cluster("dask", client.scheduler.address, workers, settle)
        finally:
            client.close()
    finally:
        for process in reversed(processes):
            stop(process)


@pytest.fixture(scope="module")  # only this file's: stopped with it, not left idle
def ray_cluster(home: Home) -> Iterator[Cluster]:
    """A Ray head with two CPUs, ``ray start --head --block``: stopping that process stops its cluster."""
    import psutil

    temp = tempfile.mkdtemp(prefix="rc-ray-", dir="/tmp")  # short: Ray's socket paths must fit
    port = free_port()
    # Token authentication with a token of this session, in the environment of the head and of
    # this process: nothing read from or written to ~/.ray (a token left there by a local
    # ray.init() would otherwise be sent to this head).
    saved = {name: os.environ.get(name) for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)})
    if "ray" in sys.modules:  # Ray read its auth mode when it was imported: it reads it again
        from ray._raylet import Config

        Config.initialize("")
    ports = ["--port", str(port), "--ray-client-server-port", str(free_port())]
    ports += ["--dashboard-port", str(free_port())]
    small = ["--num-cpus", "2", "--include-dashboard=false", "--disable-usage-stats", "--temp-dir", temp]
    head = home.spawn(
        "ray-head",
        str(BIN / "ray"),
        "start",
        "--head",
        "--block",
        "--node-ip-address",
        "127.0.0.1",
        *ports,
        *small,
    )
    log = home.base / "ray-head.log"
    try:
        wait_for(
            "the Ray head", lambda: "Ray runtime started" in log.read_text(errors="replace"), [head], home
        )

        def workers() -> dict[int, str]:
            found = {}
            for process in psutil.Process(head.pid).children(recursive=True):
                try:
                    title = process.cmdline()
                except psutil.Error:
                    continue
                if title and title[0].startswith("ray::") and "Agent" not in title[0]:
                    found[process.pid] = "" if title[0].startswith("ray::IDLE") else title[0]
            return found

        yield Cluster("ray", f"127.0.0.1:{port}", workers, lambda: None)
    finally:
        import ray

        ray.shutdown()
        stop(head)
        shutil.rmtree(temp, ignore_errors=True)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(params=RUNNERS)
def cluster(request: pytest.FixtureRequest) -> Cluster:
    found: Cluster = request.getfixturevalue(f"{request.param}_cluster")
    return found


def test_a_relative_capture_dir_on_a_cluster_started_elsewhere(
    cluster: Cluster, tmp_path: Path, corpus_dir: Path, prefect_api: str
) -> None:
    """The issue's command, from the run's folder: the workers' own folder has no ``caps``."""
    write_run(tmp_path, corpus_dir)
    expected = enrich(tmp_path, "threads")
    address = f"--{cluster.runner}-address"
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    args = ["enrich", "rollouts.jsonl", "--capture-dir", "caps", "--output", "cluster.jsonl"]
    args += ["--batch-size", "7", "--runner", cluster.runner, address, cluster.address, "--json"]
    done = subprocess.run(
        [sys.executable, "-m", "rollout_capture.cli", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    summary = orjson.loads(done.stdout)
    assert summary["stats"]["rollouts"] == 40 and summary["stats"]["calls"] > 40
    assert (tmp_path / "cluster.jsonl").read_bytes() == expected


def test_a_worker_killed_mid_batch_leaves_the_output_complete_and_identical(
    cluster: Cluster, tmp_path: Path, corpus_dir: Path
) -> None:
    """The batch holding a claimed rollout waits on a worker; every worker busy with a batch
    then is SIGKILLed.

    The batch runs again elsewhere (Dask reschedules it, Ray retries it), and once the
    claimed call's row lands the output is the threads runner's, byte for byte.
    """
    write_run(tmp_path, corpus_dir)
    store = CaptureStore(tmp_path / "caps")
    claim = store.claim("3-0")
    claim.__enter__()
    since = datetime.now(UTC)
    stop_event = threading.Event()
    killed: list[int] = []

    def kill_the_waiting_worker() -> None:
        try:
            while not stop_event.is_set() and not running_task_runs("await_quiescence", since):
                stop_event.wait(0.05)
            while not stop_event.is_set() and not killed:
                busy = {pid: running for pid, running in cluster.workers().items() if running}
                for pid in busy:
                    os.kill(pid, signal.SIGKILL)
                killed.extend(busy)
                stop_event.wait(0.05)
        finally:
            store.record("3-0", {"model_call_id": "late", "dialect": "chat"})
            claim.__exit__(None, None, None)

    killer = threading.Thread(target=kill_the_waiting_worker)
    killer.start()
    try:
        state = enrich_rollouts(
            str(tmp_path / "rollouts.jsonl"),
            str(tmp_path / "caps"),
            output=str(tmp_path / "cluster.jsonl"),
            batch_size=7,
            max_workers=2,
            quiescence_timeout_s=120,
            return_state=True,
            **cluster.options(),
        )
    finally:
        stop_event.set()
        killer.join(30)
    summary = state.result()
    assert killed and not any(_alive(pid) for pid in killed)
    assert summary.batches == 6 and summary.stats.rollouts == 40
    merged = eventually(
        lambda: task_runs(state.state_details.flow_run_id, "merge_batch", at_least=6),
        lambda runs: len(runs) == 6 and all(run.state_name == "Completed" for run in runs),
    )
    assert len(merged) == 6 and all(run.state_name == "Completed" for run in merged)
    # In the UI, the killed batch went back to Pending and ran again; the others ran once.
    (again,) = [run for run in merged if run.name == "merge_batch lines 1-7"]
    assert state_history(again.id) == ["Pending", "Running", "Pending", "Running", "Completed"]
    output = (tmp_path / "cluster.jsonl").read_bytes()
    record = orjson.loads(output.splitlines()[3])
    assert record["ng_model_call_capture"]["calls"][-1]["model_call_id"] == "late"
    assert output == enrich(tmp_path, "threads")
    cluster.settle()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z")


def test_a_worker_that_cannot_see_the_capture_dir_fails_naming_it(
    cluster: Cluster, home: Home, tmp_path: Path, corpus_dir: Path
) -> None:
    """Never every rollout ``no_records`` and a green run: the batch fails naming path and worker."""
    if not home.blinded:
        pytest.skip(home.why_not)
    run = Path(tempfile.mkdtemp(dir=home.blind))
    write_run(run, corpus_dir)
    state = enrich_rollouts(
        str(run / "rollouts.jsonl"),
        str(run / "caps"),
        output=str(tmp_path / "out.jsonl"),
        batch_size=7,
        return_state=True,
        **cluster.options(),
    )
    with pytest.raises(FileNotFoundError) as failed:
        state.result()
    message = str(failed.value)
    assert f"capture dir {run / 'caps'} does not exist on worker {socket.gethostname()} (pid " in message
    assert not (tmp_path / "out.jsonl").exists()
    # In the UI: the batch's task run failed with the same message.
    failures = failed_task_runs(state.state_details.flow_run_id, "merge_batch")
    assert failures and all(socket.gethostname() in (r.state.message or "") for r in failures if r.state)


def failed_task_runs(flow_run_id: UUID, name: str) -> list[TaskRun]:
    return eventually(lambda: [r for r in task_runs(flow_run_id, name) if r.state_name == "Failed"], bool)


def test_the_scheduled_job_sends_every_run_to_the_cluster(
    cluster: Cluster, home: Home, tmp_path: Path, corpus_dir: Path
) -> None:
    """``enrich_completed_runs`` with the cluster's address: each run's batches go there.

    A run the cluster's workers can see is enriched as the threads runner would; one they
    cannot fails naming the worker, which only a worker of that cluster would.
    """
    runs = tmp_path / "runs"
    expected = _run_folder(runs / "r1", corpus_dir)
    summary = enrich_completed_runs(str(runs), batch_size=7, **cluster.options())
    assert summary.enriched == ["r1"]
    assert (runs / "r1" / "rollouts.enriched.jsonl").read_bytes() == expected
    if not home.blinded:
        pytest.skip(home.why_not)
    hidden = Path(tempfile.mkdtemp(dir=home.blind)) / "runs"
    _run_folder(hidden / "r2", corpus_dir)
    with pytest.raises(RunsFailed) as failed:
        enrich_completed_runs(str(hidden), batch_size=7, **cluster.options())
    captures = hidden / "r2" / "captures"
    assert f"capture dir {captures} does not exist on worker {socket.gethostname()}" in str(failed.value)
    assert not (hidden / "r2" / "_ENRICHED").exists()


def _run_folder(run: Path, corpus_dir: Path) -> bytes:
    """A finished run (rollouts.jsonl, captures/, _SUCCESS); returns its threads-runner output."""
    write_run(run, corpus_dir)
    expected = enrich(run, "threads")
    (run / "threads.jsonl").unlink()
    (run / "caps").rename(run / "captures")
    (run / "_SUCCESS").touch()
    return expected


def test_an_rl_jobs_own_ray_connection_is_used_and_left_open(
    ray_cluster: Cluster, tmp_path: Path, corpus_dir: Path
) -> None:
    """Called from a driver already connected to Ray (an RL job's): no address needed, and the
    job's connection is still there afterwards; a second cluster in the same process is refused."""
    import ray

    from rollout_capture.flows.runners import _ray_connection

    write_run(tmp_path, corpus_dir)
    ray.init(address=ray_cluster.address, log_to_driver=False)
    try:
        output = enrich(tmp_path, "ray", runner="ray")
        assert ray.is_initialized()
        refused = pytest.raises(ValueError, match="one Ray cluster per process")
        with _ray_connection(None), refused, _ray_connection("127.0.0.1:1"):
            pass
        assert ray.is_initialized()
    finally:
        ray.shutdown()
    assert output == enrich(tmp_path, "threads")
