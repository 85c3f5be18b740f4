"""Seconds from ``rollout-capture finish RUN`` to the run's ``_ENRICHED``, on a real server and worker,
split into phases.

    python benchmarks/bench_finish.py [--runs 10] [--poll 1] [--json]

Starts ``prefect server start`` (its own PREFECT_HOME, a free port), registers the shipped
deployments for a temporary runs root with a yearly cron (no tick comes: only the trigger can
enrich), starts one process worker (its query interval ``--poll`` seconds; Prefect's default
when not given), waits for a warm-up run to be enriched (the triggers service loads a new
deployment's trigger in the background), then finishes ``--runs`` runs of the bundled sample one
after another and times each, from the start of the ``finish`` command to ``_ENRICHED``.

Each run's time is split by the flow run the trigger created (its creation and state times, read
from the API afterwards; the server's clock is this machine's):

- ``finish``: the command, start to exit (ours: start-up, the run folder checked, ``_SUCCESS``
  written, the event sent);
- ``trigger``: the command's exit to the flow run's creation (the server: the event received,
  the automation fired);
- ``worker poll``: creation to ``Pending`` (the worker's next query of its pool);
- ``process start``: ``Pending`` to ``Running`` (the worker starting a Python process that imports
  Prefect and our flow);
- ``flow``: ``Running`` to ``_ENRICHED`` seen (ours: the tick's discovery, lease, enrichment).

Min, median and max of each are printed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_cli import BIN, SAMPLE, base_env, cli, prefect_server

POOL = "bench-finish"
NAME = "bench-finish"
PHASES = ("finish", "trigger", "worker poll", "process start", "flow", "total")


def make_run(root: Path, name: str) -> Path:
    run = root / name
    run.mkdir(parents=True)
    shutil.copy(SAMPLE / "rollouts.jsonl", run / "rollouts.jsonl")
    shutil.copytree(SAMPLE / "captures", run / "captures")
    return run


def finish_to_enriched(run: Path, env: dict[str, str], timeout_s: float = 300) -> dict[str, float]:
    """Wall-clock moments (``time.time``): the command's start and exit, ``_ENRICHED`` seen."""
    started = time.time()
    done = subprocess.run([*cli(), "finish", str(run)], env=env, capture_output=True, text=True)
    exited = time.time()
    if done.returncode != 0:
        raise SystemExit(f"finish exited {done.returncode}: {done.stderr}")
    while not (run / "_ENRICHED").exists():
        if time.time() - started > timeout_s:
            raise SystemExit(f"{run} not enriched after {timeout_s} s")
        time.sleep(0.02)
    return {"started": started, "exited": exited, "enriched": time.time()}


def flow_run_moments(api: str, after: float) -> dict[str, float]:
    """The first flow run of the scheduled deployment created after ``after``: its creation, and
    its first ``Pending`` and ``Running`` states, as wall-clock moments."""
    import os

    os.environ["PREFECT_API_URL"] = api
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[NAME])),
            sort=FlowRunSort.START_TIME_ASC,
            limit=200,
        )
        mine = sorted(
            (r for r in runs if r.created and r.created.timestamp() >= after), key=lambda r: r.created
        )
        if not mine:
            raise SystemExit("no flow run was created for the finished run")
        states = client.read_flow_run_states(mine[0].id)
    moments: dict[str, Any] = {"created": mine[0].created.timestamp()}  # type: ignore[union-attr]
    for state in sorted(states, key=lambda s: s.timestamp):
        moments.setdefault(state.type.value.lower(), state.timestamp.timestamp())
    return moments


def phases(command: dict[str, float], flow_run: dict[str, float]) -> dict[str, float]:
    return {
        "finish": command["exited"] - command["started"],
        "trigger": flow_run["created"] - command["exited"],
        "worker poll": flow_run["pending"] - flow_run["created"],
        "process start": flow_run["running"] - flow_run["pending"],
        "flow": command["enriched"] - flow_run["running"],
        "total": command["enriched"] - command["started"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--poll", type=float, default=None, help="the worker's query interval, seconds")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-finish-") as scratch:
        work = Path(scratch)
        root = work / "runs"
        root.mkdir()
        with prefect_server(work / "home", work / "server.log") as api:
            env = base_env(work / "home", api)
            deploy = [*cli(), "deploy", "--runs-root", str(root), "--pool", POOL, "--name", NAME]
            subprocess.run([*deploy, "--cron", "0 0 1 1 *"], env=env, check=True, capture_output=True)
            worker_env = base_env(work / "worker-home", api)
            if args.poll is not None:
                worker_env["PREFECT_WORKER_QUERY_SECONDS"] = str(args.poll)
            with (work / "worker.log").open("wb") as log:
                worker = subprocess.Popen(
                    [str(BIN / "prefect"), "worker", "start", "--pool", POOL],
                    env=worker_env,
                    cwd=work,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            try:
                warm = make_run(root, "warm-up")
                deadline = time.monotonic() + 180
                while True:  # finish again until the trigger is loaded and the run enriched
                    try:
                        warm_moments = finish_to_enriched(warm, env, timeout_s=30)
                        break
                    except SystemExit:
                        if time.monotonic() > deadline:
                            raise
                measured = []
                for i in range(args.runs):
                    command = finish_to_enriched(make_run(root, f"run-{i}"), env)
                    measured.append(phases(command, flow_run_moments(api, command["started"])))
            finally:
                worker.send_signal(signal.SIGINT)
                worker.wait(60)
    summary = {
        phase: {
            "min_s": round(min(m[phase] for m in measured), 2),
            "median_s": round(statistics.median(m[phase] for m in measured), 2),
            "max_s": round(max(m[phase] for m in measured), 2),
        }
        for phase in PHASES
    }
    result = {
        "runs": args.runs,
        "worker_poll_s": args.poll if args.poll is not None else "default",
        "warm_up_s": round(warm_moments["enriched"] - warm_moments["started"], 2),
        "phases": summary,
        "each_total_s": [round(m["total"], 2) for m in measured],
    }
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"finish -> _ENRICHED over {args.runs} runs (worker poll {result['worker_poll_s']} s; "
        f"warm-up {result['warm_up_s']} s)"
    )
    print(f"{'phase':<14} {'min':>7} {'median':>7} {'max':>7}")
    for phase, figures in summary.items():
        print(f"{phase:<14} {figures['min_s']:>7.2f} {figures['median_s']:>7.2f} {figures['max_s']:>7.2f}")


if __name__ == "__main__":
    main()
