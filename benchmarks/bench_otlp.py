"""OTLP trace export throughput and peak memory: 10k rollouts, 30k calls, one trace each.

    python benchmarks/bench_otlp.py [--rollouts 10000] [--calls-per-rollout 3] [--phoenix]

The enriched file is synthesized once (cached under benchmarks/_corpus/): each rollout's
capture rows come from the shared corpus (``examples.samples.capture_rows``, all three
dialects), cut to ``--calls-per-rollout`` calls, every tenth rollout with an agent invocation
owning its calls, and enriched by the real merge. The export then runs in a fresh
interpreter (so its peak RSS is its own, ``/proc/self/status`` VmHWM, with
``resource.getrusage``'s ``ru_maxrss`` beside it) against (a) a local receiver in its own
process, a tiny HTTP server answering 200 and counting requests and bytes, and (b) with
``--phoenix``, a real ``phoenix serve``. Prints one JSON object. Target: <= 30 s for (a).
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


def build_enriched(rollouts: int, calls_per_rollout: int) -> Path:
    """The enriched JSONL of ``rollouts`` rollouts of ``calls_per_rollout`` calls each (cached)."""
    root = corpus.CACHE / f"otlp-r{rollouts}-c{calls_per_rollout}"
    enriched = root / "rollouts.enriched.jsonl"
    if enriched.exists():
        return enriched
    captures = root / "captures"
    captures.mkdir(parents=True, exist_ok=True)
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
    from benchmarks.corpus import peak_rss_kb
    from rollout_capture.traces.exporter import export_traces
    started = time.perf_counter()
    cpu = time.process_time()
    counts = export_traces({path!r}, {url!r}, project={project!r})
    seconds = time.perf_counter() - started
    print(json.dumps({{
        "seconds": round(seconds, 2),
        "cpu_s": round(time.process_time() - cpu, 2),
        "rollouts": counts.rollouts, "calls": counts.calls, "spans": counts.spans, "batches": counts.batches,
        "spans_per_s": round(counts.spans / seconds),
        "rollouts_per_s": round(counts.rollouts / seconds),
        "peak_rss_mb": round(peak_rss_kb() / 1024, 1),
        "ru_maxrss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }}))
"""


def measure_export(path: Path, url: str, project: str | None = None) -> dict[str, object]:
    """Export ``path`` to ``url`` in a fresh interpreter; its figures as a dict."""
    code = _EXPORT.format(root=str(HERE.parent), path=str(path), url=url, project=project)
    env = {**os.environ, "PREFECT_HOME": tempfile.mkdtemp()}
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env)
    figures: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


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
        # Phoenix inserts asynchronously: how long until every span is readable
        started = time.perf_counter()
        wanted = int(str(figures["spans"]))
        seen = 0
        while time.perf_counter() - started < 300:
            with urllib.request.urlopen(f"{url}/v1/projects/bench/traces?limit=1", timeout=30):
                pass
            seen = _count_spans(url)
            if seen >= wanted:
                break
            time.sleep(1)
        figures["ingested_spans"] = seen
        figures["ingested_after_s"] = round(time.perf_counter() - started, 1)
        return figures
    finally:
        process.terminate()
        process.wait(30)


def _count_spans(url: str) -> int:
    total, cursor = 0, None
    while True:
        query = "limit=1000" + (f"&cursor={cursor}" if cursor else "")
        with urllib.request.urlopen(f"{url}/v1/projects/bench/spans?{query}", timeout=60) as answer:
            page = json.load(answer)
        total += len(page["data"])
        cursor = page.get("next_cursor")
        if not cursor:
            return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=10_000)
    parser.add_argument("--calls-per-rollout", type=int, default=3)
    parser.add_argument("--phoenix", action="store_true", help="also export to a real phoenix serve")
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
        result["local_receiver"] = measure_export(path, url)
        with urllib.request.urlopen(f"{url}/stats", timeout=10) as answer:
            result["local_receiver"]["received"] = json.load(answer)  # type: ignore[index]
    finally:
        receiver.terminate()
        receiver.wait(10)
    if args.phoenix:
        result["phoenix"] = _phoenix(path)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
