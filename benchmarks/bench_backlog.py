"""A backlog of finished runs against one file of the same rollouts, on a running Prefect server.

    python benchmarks/bench_backlog.py [--runs 1000] [--rollouts-per-run 10] [--fair-runs 300]
        [--baseline-ref main | --baseline /tmp/base/pkg] [--baseline-runs 100]
        [--memory 10000 100000 1000000] [--api http://127.0.0.1:4200/api]

Builds ``--runs`` run folders of ``--rollouts-per-run`` rollouts each (records from the shared
NeMo Gym corpus, captures synthesized by ``examples/samples.py`` as in ``corpus.py``: several
calls a rollout, all three dialects, some verifier rows) and one rollouts file holding the same
rollouts (its captures hard links to the runs'). Each measurement runs in a fresh process
against one Prefect server (started here unless ``--api`` names one), timed from the flow call
(imports done), counting every HTTP request the process sends the API and every event it emits:

- ``enrich_completed_runs`` over the runs: runs a second, API calls and task runs a run;
- ``enrich_rollouts`` of the one file of the same rollouts;
- the same pair at ``--fair-runs`` runs (the issue's "at most 10 times" ratio);
- with ``--baseline-ref`` (a git ref of this repository, its tree taken with ``git archive``) or
  ``--baseline`` (such a package tree: ``rollout_capture/`` with ``flows``, ``tasks``,
  ``deployments``, ``cli`` linked in), the same measurements of that code in the same run (its
  tick over ``--baseline-runs`` runs: the old one is slow), so ratios compare like with like on
  a shared machine;
- ``--memory``: peak RSS of ``enrich_rollouts`` (threads) on ``bench_flow.big_input(n)`` for each
  n (one rollout in a hundred captured), with ``os.access`` calls a rollout, each code.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


# ---------------------------------------------------------------------- the measured process


def _count_api(counts: Counter[str], events: Counter[str]) -> None:
    """Count each request this process sends (by method and path) and each event it emits."""
    import httpx
    from prefect.events.clients import EventsClient

    send_async, send_sync, emit = httpx.AsyncClient.send, httpx.Client.send, EventsClient.emit

    def key(request: httpx.Request) -> str:
        return f"{request.method} {_UUID.sub('{id}', request.url.path)}"

    async def counted_async(self: Any, request: httpx.Request, *args: Any, **kwargs: Any) -> Any:
        counts[key(request)] += 1
        return await send_async(self, request, *args, **kwargs)

    def counted_sync(self: Any, request: httpx.Request, *args: Any, **kwargs: Any) -> Any:
        counts[key(request)] += 1
        return send_sync(self, request, *args, **kwargs)

    async def counted_emit(self: Any, event: Any) -> None:
        events[".".join(event.event.split(".")[:2])] += 1
        await emit(self, event)

    httpx.AsyncClient.send = counted_async  # type: ignore[method-assign]
    httpx.Client.send = counted_sync  # type: ignore[method-assign]
    EventsClient.emit = counted_emit  # type: ignore[method-assign]


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def child(kind: str, target: str, captures: str, output: str) -> None:
    """One measurement in this (fresh) process; prints its figures as one JSON line."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    from rollout_capture.flows.enrich import enrich_rollouts
    from rollout_capture.flows.enrich_runs import enrich_completed_runs

    counts: Counter[str] = Counter()
    events: Counter[str] = Counter()
    accesses = [0]
    if kind == "memory":
        access = os.access

        def counted_access(*args: Any, **kwargs: Any) -> bool:
            accesses[0] += 1
            return access(*args, **kwargs)

        os.access = counted_access  # type: ignore[assignment]
    else:
        _count_api(counts, events)
    started = time.perf_counter()
    if kind == "runs":
        state = enrich_completed_runs(target, return_state=True)
        result: dict[str, Any] = {"flow_run_id": str(state.state_details.flow_run_id)}
        if state.is_completed():
            summary = state.result()
            result.update(enriched=len(summary.enriched), failed=len(summary.failed))
        else:  # some runs failed (the code before fails runs on the server's 503s under load)
            failed = re.match(r".*?(\d+) run\(s\) failed", state.message or "")
            result.update(enriched=None, failed=int(failed.group(1)) if failed else None)
            result["error"] = (state.message or "")[:500]
    else:
        state = enrich_rollouts(target, captures, output=output, return_state=True)
        result = {
            "rollouts": state.result().stats.rollouts,
            "flow_run_id": str(state.state_details.flow_run_id),
        }
    result["seconds"] = round(time.perf_counter() - started, 3)
    for service in (EventsWorker, APILogWorker):  # what is still queued is part of the cost
        service.drain_all(timeout=60)
    result["requests"] = dict(counts)
    result["events"] = dict(events)
    result["peak_rss_mb"] = round(_peak_rss_mb(), 1)
    result["os_access"] = accesses[0]
    result["code"] = os.path.dirname(sys.modules["rollout_capture"].__file__ or "")
    print("RESULT " + json.dumps(result))


# ---------------------------------------------------------------------- the benchmark


def build(runs: int, per_run: int) -> Path:
    """``runs/<run>/`` (rollouts, captures, ``_SUCCESS``), built once under ``benchmarks/_corpus``."""
    import orjson

    from benchmarks.corpus import CACHE, source_corpus
    from examples.samples import DIALECTS, capture_rows, corpus_records, jsonl_bytes
    from rollout_capture.names import jsonl_name

    base = CACHE / f"backlog-{runs}x{per_run}"
    if (base / "done").exists():
        return base
    shutil.rmtree(base, ignore_errors=True)
    records = corpus_records(source_corpus())
    for run in range(runs):
        folder = base / "runs" / f"run-{run:05d}"
        (folder / "captures").mkdir(parents=True)
        lines = []
        for offset in range(per_run):
            index = run * per_run + offset
            record = dict(records[index % len(records)])
            record["_ng_task_index"], record["_ng_rollout_index"] = index // 4, index % 4
            rollout_id = f"{index // 4}-{index % 4}"
            rows = capture_rows(
                record, rollout_id, dialect=DIALECTS[index % 3], seed=index, repeat=2, verifier=index % 5 == 0
            )
            data = jsonl_bytes(rows) + (b'{"torn": ' if index % 97 == 0 else b"")
            (folder / "captures" / jsonl_name(rollout_id)).write_bytes(data)
            lines.append(orjson.dumps(record) + b"\n")
        (folder / "rollouts.jsonl").write_bytes(b"".join(lines))
        (folder / "_SUCCESS").write_bytes(b"")
    (base / "done").write_text("")
    return base


def fresh_runs(template: Path, count: int, work: Path) -> Path:
    """A runs root of the template's first ``count`` runs, hard-linked (the tick writes new files only)."""
    root = Path(tempfile.mkdtemp(prefix="runs-", dir=work))
    for run in sorted((template / "runs").iterdir())[:count]:
        shutil.copytree(run, root / run.name, copy_function=os.link)
    return root


def one_file(template: Path, runs: int, work: Path) -> Path:
    """The first ``runs`` runs' rollouts in one file, their captures linked into one folder beside it."""
    folder = Path(tempfile.mkdtemp(prefix="one-", dir=work))
    (folder / "captures").mkdir()
    with (folder / "rollouts.jsonl").open("wb") as out:
        for run in sorted((template / "runs").iterdir())[:runs]:
            out.write((run / "rollouts.jsonl").read_bytes())
            for capture in (run / "captures").iterdir():
                os.link(capture, folder / "captures" / capture.name)
    return folder


def measure(
    kind: str, target: str, captures: str = "", *, code: str | None, env: dict[str, str], work: Path
) -> dict[str, Any]:
    """Run one measurement in a fresh process with ``code``'s package (None: this checkout's)."""
    child_env = dict(env)
    if code is not None:
        child_env["PYTHONPATH"] = code
    output = str(Path(tempfile.mkdtemp(prefix="out-", dir=work)) / "out.jsonl")
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", kind, target, captures, output],
        capture_output=True,
        text=True,
        env=child_env,
        cwd=tempfile.gettempdir(),
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{kind} {target} failed ({done.returncode}): {done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    result["api_calls"] = sum(result["requests"].values())
    return result


def task_runs_of(flow_run_id: str) -> dict[str, int]:
    """Task runs and flow runs the tick made (its subflows' too), from the API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId

    with get_client(sync_client=True) as client:
        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
        )
        ids = [flow_run_id, *(str(f.id) for f in children)]
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)), limit=200)
        count = len(tasks)
        while len(tasks) == 200:  # paged: the old tick makes thousands
            tasks = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)), limit=200, offset=count
            )
            count += len(tasks)
    return {"task_runs": count, "flow_runs": len(ids)}


def pair(
    template: Path, runs: int, per_run: int, work: Path, code: str | None, env: dict[str, str]
) -> dict[str, Any]:
    """``enrich-runs`` over ``runs`` runs and ``enrich`` of their rollouts in one file, one code."""
    one = one_file(template, runs, work)
    single = measure(
        "enrich", str(one / "rollouts.jsonl"), str(one / "captures"), code=code, env=env, work=work
    )
    tick = measure("runs", str(fresh_runs(template, runs, work)), code=code, env=env, work=work)
    shutil.rmtree(one, ignore_errors=True)
    if code is None:
        assert tick["enriched"] == runs and not tick["failed"], tick
    tick.update(task_runs_of(tick["flow_run_id"]))
    return {
        "runs": runs,
        "rollouts": runs * per_run,
        "enrich_one_file_s": single["seconds"],
        "enrich_one_file_api_calls": single["api_calls"],
        "enrich_runs_s": tick["seconds"],
        "runs_failed": tick["failed"],
        "tick_error": tick.get("error"),
        "runs_per_s": round(runs / tick["seconds"], 2),
        "api_calls_per_run": round(tick["api_calls"] / runs, 2),
        "events_per_run": round(sum(tick["events"].values()) / runs, 2),
        "task_runs_per_run": round(tick["task_runs"] / runs, 2),
        "flow_runs": tick["flow_runs"],
        "enrich_runs_over_enrich": round(tick["seconds"] / single["seconds"], 2),
        "enrich_runs_peak_rss_mb": tick["peak_rss_mb"],
        "enrich_one_file_peak_rss_mb": single["peak_rss_mb"],
        "requests": dict(Counter(tick["requests"]).most_common(12)),
        "events": tick["events"],
    }


def memory(sizes: list[int], code: str | None, env: dict[str, str], work: Path) -> dict[str, Any]:
    """Peak RSS (and ``os.access`` calls a rollout) of ``enrich_rollouts`` at each size."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_flow import big_input

    out = {}
    for size in sizes:
        rollouts, captures = big_input(size)
        found = measure("memory", str(rollouts), str(captures), code=code, env=env, work=work)
        out[str(size)] = {
            "seconds": found["seconds"],
            "peak_rss_mb": found["peak_rss_mb"],
            "os_access_per_rollout": round(found["os_access"] / size, 2),
        }
    return out


def package_tree(ref: str, work: Path) -> Path:
    """The package of a git ref of this repository, importable as it installs (PYTHONPATH)."""
    tree, package = work / "baseline-tree", work / "baseline-package"
    tree.mkdir()
    archive = subprocess.run(["git", "archive", ref], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    shutil.copytree(tree / "rollout_capture", package / "rollout_capture")
    for folder in ("flows", "tasks", "deployments", "cli"):
        (package / "rollout_capture" / folder).symlink_to(tree / folder)
    return package


def run_all(args: argparse.Namespace, api: str, work: Path) -> dict[str, Any]:
    """Every measurement the arguments ask for, against the server at ``api``."""
    env = {
        **os.environ,
        "PREFECT_API_URL": api,
        "PREFECT_HOME": str(work / "client-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "INFO",  # a deployment's default: its logs are part of the cost
    }
    os.environ.update({"PREFECT_API_URL": api, "PREFECT_HOME": env["PREFECT_HOME"]})
    codes: list[tuple[str, str | None]] = [("now", None)]
    if args.baseline_ref:
        codes.append(("before", str(package_tree(args.baseline_ref, work))))
    elif args.baseline:
        codes.append(("before", str(Path(args.baseline).resolve())))
    results: dict[str, Any] = {"cores": os.cpu_count(), "load_before": os.getloadavg()}
    if len(codes) > 1:
        results["before"] = args.baseline_ref or args.baseline
    template = build(args.runs, args.rollouts_per_run)
    warm = one_file(template, 1, work)  # the flows registered, the server warmed: untimed
    measure("enrich", str(warm / "rollouts.jsonl"), str(warm / "captures"), code=None, env=env, work=work)
    for name, code in codes:  # the ratio at --fair-runs first (the code before: fewer runs, it is slow)
        runs = args.fair_runs if code is None else min(args.fair_runs, args.baseline_runs)
        results[f"{name}_fair"] = pair(template, runs, args.rollouts_per_run, work, code, env)
    for name, code in codes:
        runs = args.runs if code is None else min(args.runs, args.baseline_runs)
        if code is not None and runs == results[f"{name}_fair"]["runs"]:
            continue  # measured already
        results[f"{name}_backlog"] = pair(template, runs, args.rollouts_per_run, work, code, env)
    for name, code in codes:
        if args.memory:
            results[f"{name}_memory"] = memory(args.memory, code, env, work)
    now = results["now_backlog"]
    results["targets"] = {
        "fair_ratio_at_most_10": results["now_fair"]["enrich_runs_over_enrich"] <= 10,
        f"{args.runs}_runs_within_60_s": now["runs"] == args.runs and now["enrich_runs_s"] <= 60,
        "api_calls_per_run_at_most_3": now["api_calls_per_run"] <= 3,
    }
    if args.memory and len(args.memory) >= 2:
        peaks = results["now_memory"]
        small, big = peaks[str(sorted(args.memory)[-2])], peaks[str(max(args.memory))]
        results["targets"]["memory_peak_within_1.5x"] = big["peak_rss_mb"] <= 1.5 * small["peak_rss_mb"]
    results["load_after"] = os.getloadavg()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--rollouts-per-run", type=int, default=10)
    parser.add_argument("--fair-runs", type=int, default=300, help="the enrich-runs / enrich ratio's size")
    parser.add_argument("--baseline-ref", help="a git ref whose code to compare with (e.g. main)")
    parser.add_argument("--baseline", help="a package tree of the code to compare with (see above)")
    parser.add_argument("--baseline-runs", type=int, default=100, help="the baseline tick's runs")
    parser.add_argument("--memory", type=int, nargs="*", default=[], help="enrich's peak RSS at these sizes")
    parser.add_argument("--api", help="a running Prefect server's API URL (default: one started here)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_cli import prefect_server

    work = Path(tempfile.mkdtemp(prefix="bench-backlog-"))
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, work, ignore_errors=True)
        api = args.api or stack.enter_context(prefect_server(work / "server-home", work / "server.log"))
        results = run_all(args, api, work)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:6])
    else:
        main()
