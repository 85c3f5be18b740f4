"""Seconds from ``rollout-capture finish RUN`` to the run's ``_ENRICHED``, on a real server and worker.

    python benchmarks/bench_finish.py [--runs 5] [--json]

Starts ``prefect server start`` (its own PREFECT_HOME, a free port), registers the shipped
deployments for a temporary runs root with a yearly cron (no tick comes: only the trigger can
enrich), starts one process worker (default polling), waits for a warm-up run to be enriched
(the triggers service loads a new deployment's trigger in the background), then finishes
``--runs`` runs of the bundled sample one after another and times each, from the start of the
``finish`` command to ``_ENRICHED``. Min and median are printed.
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

from bench_cli import BIN, SAMPLE, base_env, cli, prefect_server

POOL = "bench-finish"


def make_run(root: Path, name: str) -> Path:
    run = root / name
    run.mkdir(parents=True)
    shutil.copy(SAMPLE / "rollouts.jsonl", run / "rollouts.jsonl")
    shutil.copytree(SAMPLE / "captures", run / "captures")
    return run


def finish_to_enriched(run: Path, env: dict[str, str], timeout_s: float = 300) -> float:
    started = time.perf_counter()
    done = subprocess.run([*cli(), "finish", str(run)], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"finish exited {done.returncode}: {done.stderr}")
    while not (run / "_ENRICHED").exists():
        if time.perf_counter() - started > timeout_s:
            raise SystemExit(f"{run} not enriched after {timeout_s} s")
        time.sleep(0.1)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-finish-") as scratch:
        work = Path(scratch)
        root = work / "runs"
        root.mkdir()
        with prefect_server(work / "home", work / "server.log") as api:
            env = base_env(work / "home", api)
            deploy = [*cli(), "deploy", "--runs-root", str(root), "--pool", POOL, "--cron", "0 0 1 1 *"]
            subprocess.run(deploy, env=env, check=True, capture_output=True)
            worker_env = base_env(work / "worker-home", api)
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
                        warm_up_s = finish_to_enriched(warm, env, timeout_s=30)
                        break
                    except SystemExit:
                        if time.monotonic() > deadline:
                            raise
                times = [finish_to_enriched(make_run(root, f"run-{i}"), env) for i in range(args.runs)]
            finally:
                worker.send_signal(signal.SIGINT)
                worker.wait(60)
    result = {
        "runs": args.runs,
        "warm_up_s": round(warm_up_s, 2),
        "finish_to_enriched_s": [round(t, 2) for t in times],
        "min_s": round(min(times), 2),
        "median_s": round(statistics.median(times), 2),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"finish -> _ENRICHED over {args.runs} runs: min {result['min_s']} s, "
            f"median {result['median_s']} s ({result['finish_to_enriched_s']}); "
            f"warm-up {result['warm_up_s']} s"
        )


if __name__ == "__main__":
    main()
