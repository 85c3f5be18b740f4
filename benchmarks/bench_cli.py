"""Wall time of the command line as a user runs it, on the bundled sample.

    python benchmarks/bench_cli.py [--rounds 3] [--json]

Times ``rollout-capture clear`` and ``rollout-capture enrich`` (real processes, the console
script of this interpreter's environment) (a) against a running ``prefect server start``
(its own PREFECT_HOME, a free port, started and healthy before anything is timed) and (b) on
Prefect's temporary server (no PREFECT_API_URL, a PREFECT_HOME of its own), and (c) the same
two commands with a capture dir that is not there, which must exit 2 and name it, and
``python -c "import prefect"`` in the same rounds (the floor of a flow command: the ratio of
``enrich`` to it is printed; ``--running-only`` skips the temporary server). Each case
runs ``--rounds`` times, the cases interleaved; min and median are printed. Case (b) also
reports its first run, in a fresh PREFECT_HOME (the database is created then), apart.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "rollout_capture" / "sample"
BIN = Path(sys.executable).parent
TIMEOUT_S = 600


def cli() -> list[str]:
    """The console script a user runs, else the module (a plain checkout)."""
    script = BIN / "rollout-capture"
    return [str(script)] if script.exists() else [sys.executable, "-m", "rollout_capture.cli"]


def base_env(prefect_home: Path, api_url: str | None) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(prefect_home), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def prefect_server(home: Path, log: Path) -> Iterator[str]:
    """``prefect server start`` on a free loopback port, until /api/health answers."""
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = base_env(home, None)
    command = [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as out:
        server = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            if server.poll() is not None:
                raise SystemExit(f"prefect server exited {server.returncode}; see {log}")
            try:
                with urllib.request.urlopen(f"{api}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"prefect server not healthy after 180 s; see {log}")
            time.sleep(0.25)
        yield api
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def timed(args: Sequence[str], env: dict[str, str], cwd: Path, expect: int) -> float:
    """Wall time of one command; it must exit ``expect``, and a refusal must name the capture dir."""
    started = time.perf_counter()
    done = subprocess.run(
        [*cli(), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    elapsed = time.perf_counter() - started
    if done.returncode != expect:
        raise SystemExit(f"{args[0]} exited {done.returncode}, not {expect}:\n{done.stdout}\n{done.stderr}")
    if expect and args[args.index("--capture-dir") + 1] not in done.stderr:
        raise SystemExit(f"{args[0]} refused without naming the capture dir:\n{done.stderr}")
    return elapsed


def is_record(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


class Cases:
    """The commands, each on inputs of its own (clear removes captures: a fresh copy per round).

    ``clear`` gets the sample's rollout records only: it refuses (exit 2) a file with a line
    that is not a record, as the sample's placeholder line 11 is, since it must know every id.
    """

    def __init__(self, work: Path) -> None:
        self.work = work
        self.rollouts = SAMPLE / "rollouts.jsonl"
        self.records = work / "records.jsonl"
        self.records.write_bytes(b"".join(line for line in self.rollouts.open("rb") if is_record(line)))
        self.missing = work / "no-such-captures"
        self.count = 0

    def fresh(self) -> Path:
        self.count += 1
        copy = self.work / f"captures-{self.count}"
        shutil.copytree(SAMPLE / "captures", copy)
        return copy

    def clear(self) -> tuple[list[str], int]:
        return ["clear", str(self.records), "--capture-dir", str(self.fresh())], 0

    def enrich(self) -> tuple[list[str], int]:
        output = self.work / f"out-{self.count}.enriched.jsonl"
        return ["enrich", str(self.rollouts), "--capture-dir", str(self.fresh()), "--output", str(output)], 0

    def clear_missing(self) -> tuple[list[str], int]:
        return ["clear", str(self.records), "--capture-dir", str(self.missing)], 2

    def enrich_missing(self) -> tuple[list[str], int]:
        output = self.work / "never.enriched.jsonl"
        return ["enrich", str(self.rollouts), "--capture-dir", str(self.missing), "--output", str(output)], 2


CASES = ("clear", "enrich", "clear_missing", "enrich_missing")
BASELINE = "import_prefect"
"""``python -c "import prefect"``: the floor a flow command cannot go under, timed in the same rounds."""


def timed_import(env: dict[str, str], cwd: Path) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import prefect"], env=env, cwd=cwd, check=True, timeout=TIMEOUT_S)
    return time.perf_counter() - started


def measure(cases: Cases, env: dict[str, str], rounds: int) -> dict[str, dict[str, Any]]:
    """Each round runs every case once, and ``import prefect`` (interleaved, so a drift in the
    machine's load hits all)."""
    times: dict[str, list[float]] = {name: [] for name in (*CASES, BASELINE)}
    for _ in range(rounds):
        times[BASELINE].append(timed_import(env, cases.work))
        for name in CASES:
            args, expect = getattr(cases, name)()
            times[name].append(timed(args, env, cases.work, expect))
    return {
        name: {
            "min_s": round(min(runs), 3),
            "median_s": round(statistics.median(runs), 3),
            "runs_s": [round(t, 3) for t in runs],
        }
        for name, runs in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="Print one JSON document instead.")
    parser.add_argument("--running-only", action="store_true", help="Skip the temporary-server cases.")
    args = parser.parse_args()

    report: dict[str, Any] = {"rounds": args.rounds, "cpus": os.cpu_count(), "cli": " ".join(cli())}
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as tmp:
        work = Path(tmp)
        cases = Cases(work)
        started = time.perf_counter()
        with prefect_server(work / "server-home", work / "server.log") as api:
            report["server_start_s"] = round(time.perf_counter() - started, 3)
            report["running_server"] = running = measure(
                cases, base_env(work / "client-home", api), args.rounds
            )
        floor = running[BASELINE]["median_s"]
        report["enrich_over_import_prefect"] = {
            "ratio": round(running["enrich"]["median_s"] / floor, 2),
            "extra_s": round(running["enrich"]["median_s"] - floor, 3),
        }
        if not args.running_only:
            temporary = base_env(work / "temporary-home", None)
            first, expect = cases.enrich()
            report["temporary_server_first_enrich_s"] = round(timed(first, temporary, work, expect), 3)
            report["temporary_server"] = measure(cases, temporary, args.rounds)

    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{report['cli']}; {args.rounds} rounds; {report['cpus']} cpus")
    print(f"prefect server start until healthy: {report['server_start_s']:.2f} s")
    if "temporary_server_first_enrich_s" in report:
        first = report["temporary_server_first_enrich_s"]
        print(f"temporary server, first enrich (fresh PREFECT_HOME): {first:.2f} s")
    print(f"{'case':<16}{'server: min':>14}{'median':>9}{'temporary: min':>17}{'median':>9}")
    for name in (*CASES, BASELINE):
        running = report["running_server"][name]
        temp = report.get("temporary_server", {}).get(name, {"min_s": float("nan"), "median_s": float("nan")})
        print(
            f"{name:<16}{running['min_s']:>14.2f}{running['median_s']:>9.2f}"
            f"{temp['min_s']:>17.2f}{temp['median_s']:>9.2f}"
        )
    over = report["enrich_over_import_prefect"]
    print(
        f"enrich / import prefect (medians, running server): {over['ratio']:.2f}x, +{over['extra_s']:.2f} s"
    )


if __name__ == "__main__":
    main()
