"""OTLP trace export throughput and peak memory: 10k rollouts, 30k calls, one trace each.

    python benchmarks/bench_otlp.py [--rollouts 10000] [--calls-per-rollout 3] [--phoenix]
        [--huge-mb 72] [--baseline OTHER_CHECKOUT]

The enriched file is synthesized once (cached under benchmarks/_corpus/): each rollout's
capture rows come from the shared corpus (``examples.samples.capture_rows``, all three
dialects), cut to ``--calls-per-rollout`` calls, every tenth rollout with an agent invocation
owning its calls, and enriched by the real merge. The export then runs in a fresh
interpreter (so its peak RSS is its own, ``/proc/self/status`` VmHWM, with
``resource.getrusage``'s ``ru_maxrss`` beside it) against (a) a local receiver in its own
process, a tiny HTTP server answering 200 and counting requests and bytes, and (b) with
``--phoenix``, a real ``phoenix serve``. Prints one JSON object. Target: <= 30 s for (a).

``--huge-mb N`` also exports, with payloads, a file of 20 ordinary rollouts around one agent
rollout of about N MB (40 calls whose context grows by a tool result each turn, the last
requests several MB each): its time, peak RSS, bytes sent and calls cut. ``--baseline DIR``
runs every export a second time with another checkout's package (``git worktree add`` /
``git archive`` of main into /tmp), in the same run, against the same files and receiver.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import corpus
from examples.samples import DIALECTS, capture_rows, corpus_records, jsonl_bytes
from rollout_capture import merge_model_call_capture_into_record
from rollout_capture.names import jsonl_name

HERE = Path(__file__).resolve().parent


def _cached(name: str) -> tuple[Path, Path]:
    """A cached corpus's enriched file (built when missing) and its captures folder (made)."""
    root = corpus.CACHE / name
    (root / "captures").mkdir(parents=True, exist_ok=True)
    return root / "rollouts.enriched.jsonl", root / "captures"


def build_enriched(rollouts: int, calls_per_rollout: int) -> Path:
    """The enriched JSONL of ``rollouts`` rollouts of ``calls_per_rollout`` calls each (cached)."""
    enriched, captures = _cached(f"otlp-r{rollouts}-c{calls_per_rollout}")
    if enriched.exists():
        return enriched
    records = corpus_records(corpus.source_corpus())
    temp = enriched.with_suffix(".tmp")
    with temp.open("wb") as out:
        for index in range(rollouts):
            record = dict(records[index % len(records)])
            record["_ng_task_index"], record["_ng_rollout_index"] = index // 4, index % 4
            rollout_id = f"{index // 4}-{index % 4}"
            rows = capture_rows(
                record, rollout_id, dialect=DIALECTS[index % 3], seed=index, repeat=calls_per_rollout
            )[:calls_per_rollout]
            (captures / jsonl_name(rollout_id)).write_bytes(jsonl_bytes(rows))
            if index % 10 == 0:
                record["ng_agent_observations"] = {
                    "source": "bench",
                    "invocations": [
                        {
                            "invocation_id": f"inv-{rollout_id}",
                            "model_calls": [{"model_call_id": row["model_call_id"]} for row in rows],
                        }
                    ],
                    "gaps": [],
                }
            out.write(orjson.dumps(merge_model_call_capture_into_record(record, [captures])) + b"\n")
    temp.rename(enriched)
    return enriched


# ---------------------------------------------------------------------- the local receiver


def serve_receiver(port_file: str) -> None:
    """Run the receiver (in its own process): 200 to every POST, counts on GET /stats."""
    counts = {"requests": 0, "bytes": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            size = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(size)
            counts["requests"] += 1
            counts["bytes"] += size
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self) -> None:
            body = json.dumps(counts).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    Path(port_file).write_text(str(server.server_address[1]))
    server.serve_forever()


def _wait_file(path: Path, process: subprocess.Popen[bytes], timeout_s: float = 20) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists() or not path.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the receiver did not start")
        time.sleep(0.05)
    return path.read_text()


# ---------------------------------------------------------------------- one export, measured alone

_EXPORT = """if True:
    import json, resource, sys, time
    sys.path.insert(0, {root!r})
    from rollout_capture.traces.exporter import export_traces
    def peak_rss_kb():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    cpu = time.process_time()
    error = None
    try:
        counts = export_traces({path!r}, {url!r}, project={project!r}, include_payloads={payloads!r})
    except Exception as exc:  # the old code's failure is a figure too
        counts, error = None, f"{{type(exc).__name__}}: {{exc}}"[:400]
    seconds = time.perf_counter() - started
    figures = {{
        "seconds": round(seconds, 2),
        "cpu_s": round(time.process_time() - cpu, 2),
        "peak_rss_mb": round(peak_rss_kb() / 1024, 1),
        "ru_maxrss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }}
    if counts is not None:
        figures.update(
            rollouts=counts.rollouts, calls=counts.calls, spans=counts.spans, batches=counts.batches,
            spans_per_s=round(counts.spans / seconds), rollouts_per_s=round(counts.rollouts / seconds),
            calls_cut=getattr(counts, "calls_cut", None),
        )
    else:
        figures["error"] = error
    print(json.dumps(figures))
"""


def measure_export(
    path: Path, url: str, project: str | None = None, payloads: bool = False, code_root: Path | None = None
) -> dict[str, object]:
    """Export ``path`` to ``url`` in a fresh interpreter (with ``code_root``'s package: another
    checkout, for a before/after in one run); its figures as a dict."""
    root = str(code_root or HERE.parent)
    code = _EXPORT.format(root=root, path=str(path), url=url, project=project, payloads=payloads)
    env = {**os.environ, "PREFECT_HOME": tempfile.mkdtemp()}
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env)
    figures: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def build_huge(megabytes: int) -> Path:
    """20 ordinary rollouts around one agent rollout of about ``megabytes`` MB, enriched with
    payloads (cached): 40 chat calls whose context grows by a tool result each turn."""
    enriched, captures = _cached(f"otlp-huge-{megabytes}mb")
    if enriched.exists():
        return enriched
    calls, base = 40, 1_780_000_000.0
    turn = megabytes * 1_000_000 * 2 // (calls * (calls - 1))  # call i carries i tool results: N MB
    words = [f"w{i:04d}" for i in range(5000)]
    messages: list[dict[str, object]] = [
        {"role": "system", "content": "You are a careful coding agent."},
        {"role": "user", "content": "Find the bug in this repository and fix it."},
    ]
    rows = []
    for i in range(calls):
        arguments = json.dumps({"path": f"src/module_{i}.py"})
        rows.append(
            {
                "model_call_id": f"{i:032x}",
                "dialect": "chat",
                "model_ref": {"type": "responses_api_models", "name": "policy_model"},
                "started_at": base + 10 * i,
                "completed_at": base + 10 * i + 4.5,
                "latency_ms": 4500.0,
                "status_code": 200,
                "request": {"model": "policy", "messages": list(messages), "temperature": 0.6},
                "response": {
                    "id": f"chatcmpl-{i}",
                    "model": "policy",
                    "choices": [
                        {
                            "index": 0,
                            "message": {
                                "role": "assistant",
                                "content": None,
                                "tool_calls": [
                                    {
                                        "id": f"call_{i}",
                                        "type": "function",
                                        "function": {"name": "read_file", "arguments": arguments},
                                    }
                                ],
                            },
                            "finish_reason": "tool_calls",
                        }
                    ],
                    "usage": {
                        "prompt_tokens": 1000 * (i + 1),
                        "completion_tokens": 20,
                        "total_tokens": 1000 * i + 1020,
                    },
                },
            }
        )
        text = " ".join(words[(i * 7 + k) % len(words)] for k in range(turn // 6))
        messages += [
            rows[-1]["response"]["choices"][0]["message"],
            {"role": "tool", "tool_call_id": f"call_{i}", "content": text},
        ]  # type: ignore[index]
    (captures / jsonl_name("huge-0")).write_bytes(jsonl_bytes(rows))
    huge = merge_model_call_capture_into_record(
        {"_ng_rollout_id": "huge-0", "reward": 1.0}, [captures], include_payloads=True
    )
    ordinary = build_enriched(20, 3).read_bytes().splitlines()[:20]
    temp = enriched.with_suffix(".tmp")
    temp.write_bytes(b"\n".join([*ordinary[:10], orjson.dumps(huge), *ordinary[10:]]) + b"\n")
    temp.rename(enriched)
    return enriched


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _phoenix(path: Path) -> dict[str, object]:
    """The same export to a real ``phoenix serve`` (its own working dir and ports)."""
    work = Path(tempfile.mkdtemp(prefix="bench-phoenix-"))
    port = _free_port()
    env = {
        **os.environ,
        "PHOENIX_WORKING_DIR": str(work),
        "PHOENIX_PORT": str(port),
        "PHOENIX_GRPC_PORT": str(_free_port()),
        "PHOENIX_HOST": "127.0.0.1",
        "PHOENIX_TELEMETRY_ENABLED": "false",
    }
    with (work / "phoenix.log").open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "phoenix.server.main", "serve"], env=env, stdout=log, stderr=log
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{url}/healthz", timeout=2):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("phoenix did not start") from None
                time.sleep(0.5)
        figures = measure_export(path, url, project="bench")
        # Phoenix inserts asynchronously: how long until every span is stored (its own count, polled gently)
        started = time.perf_counter()
        wanted = int(str(figures["spans"]))
        seen = 0
        while time.perf_counter() - started < 900:
            seen = _count_spans(url)
            if seen >= wanted:
                break
            time.sleep(5)
        figures["ingested_spans"] = seen
        figures["ingested_after_s"] = round(time.perf_counter() - started, 1)
        return figures
    finally:
        process.terminate()
        process.wait(30)


def _count_spans(url: str) -> int:
    """The spans Phoenix holds in the bench project (GraphQL ``recordCount``: one cheap query)."""
    query = json.dumps({"query": "{ projects { edges { node { name recordCount } } } }"}).encode()
    request = urllib.request.Request(
        f"{url}/graphql", data=query, headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        edges = json.load(answer)["data"]["projects"]["edges"]
    return sum(int(e["node"]["recordCount"]) for e in edges if e["node"]["name"] == "bench")


def _stats(url: str) -> dict[str, int]:
    with urllib.request.urlopen(f"{url}/stats", timeout=10) as answer:
        stats: dict[str, int] = json.load(answer)
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=10_000)
    parser.add_argument("--calls-per-rollout", type=int, default=3)
    parser.add_argument("--phoenix", action="store_true", help="also export to a real phoenix serve")
    parser.add_argument(
        "--huge-mb", type=int, help="also export one rollout of about this many MB, with payloads"
    )
    parser.add_argument("--baseline", type=Path, help="also run every export with this checkout's package")
    parser.add_argument("--receiver", metavar="PORT_FILE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receiver:
        serve_receiver(args.receiver)
        return
    started = time.perf_counter()
    path = build_enriched(args.rollouts, args.calls_per_rollout)
    result: dict[str, object] = {
        "rollouts": args.rollouts,
        "calls_per_rollout": args.calls_per_rollout,
        "enriched_mb": round(path.stat().st_size / 2**20, 1),
        "build_s": round(time.perf_counter() - started, 1),
    }
    port_file = Path(tempfile.mkdtemp()) / "port"
    receiver = subprocess.Popen([sys.executable, __file__, "--receiver", str(port_file)])
    try:
        url = f"http://127.0.0.1:{_wait_file(port_file, receiver)}"
        runs: list[tuple[str, Path, bool]] = [("local_receiver", path, False)]
        if args.huge_mb:
            huge = build_huge(args.huge_mb)
            result["huge_enriched_mb"] = round(huge.stat().st_size / 2**20, 1)
            runs.append(("huge_with_payloads", huge, True))
        for name, file, payloads in runs:
            for label, code in (("", None), ("baseline_", args.baseline)):
                if label and code is None:
                    continue
                before = _stats(url)
                figures = measure_export(file, url, payloads=payloads, code_root=code)
                after = _stats(url)
                figures["received"] = {k: after[k] - before[k] for k in after}
                result[label + name] = figures
    finally:
        receiver.terminate()
        receiver.wait(10)
    if args.phoenix:
        result["phoenix"] = _phoenix(path)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
