"""Benchmark corpora built from the shared NeMo Gym records (generated, never committed).

A corpus is a rollouts JSONL file plus a capture directory in NeMo Gym's local layout,
several calls per rollout, all three dialects, some verifier rows, a few damaged rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

from examples.samples import DIALECTS, capture_rows, corpus_records, jsonl_bytes
from rollout_capture.names import jsonl_name

HERE = Path(__file__).resolve().parent
SHARED_CORPUS = HERE.parent.parent / "shared" / "corpus" / "nemo-gym-example-rollouts"
TEST_CORPUS = HERE.parent / "tests" / "data" / "corpus"
CACHE = HERE / "_corpus"


def source_corpus() -> Path:
    """The full shared corpus when present, else the committed slice."""
    return SHARED_CORPUS if SHARED_CORPUS.is_dir() else TEST_CORPUS


def build(rollouts: int, *, repeat: int = 2, name: str | None = None) -> tuple[Path, Path]:
    """``(rollouts.jsonl, captures dir)`` for ``rollouts`` rollouts; reused when already built."""
    root = CACHE / (name or f"r{rollouts}-x{repeat}")
    rollouts_path, captures = root / "rollouts.jsonl", root / "captures"
    manifest = root / "manifest.json"
    if manifest.exists():
        return rollouts_path, captures
    captures.mkdir(parents=True, exist_ok=True)
    records = corpus_records(source_corpus())
    started = time.perf_counter()
    capture_bytes = 0
    with rollouts_path.open("wb") as out:
        for index in range(rollouts):
            record = dict(records[index % len(records)])
            record["_ng_task_index"], record["_ng_rollout_index"] = index // 4, index % 4
            rollout_id = f"{index // 4}-{index % 4}"
            rows = capture_rows(
                record,
                rollout_id,
                dialect=DIALECTS[index % 3],
                seed=index,
                repeat=repeat,
                verifier=index % 5 == 0,
            )
            data = jsonl_bytes(rows)
            if index % 97 == 0:
                data += b'{"torn": '  # a writer killed mid-line, now and then
            (captures / jsonl_name(rollout_id)).write_bytes(data)
            capture_bytes += len(data)
            out.write(orjson.dumps(record) + b"\n")
    manifest.write_text(
        json.dumps(
            {
                "rollouts": rollouts,
                "capture_bytes": capture_bytes,
                "rollout_bytes": rollouts_path.stat().st_size,
                "build_s": round(time.perf_counter() - started, 1),
            }
        )
    )
    return rollouts_path, captures


def manifest(rollouts_path: Path) -> dict[str, int]:
    """Sizes recorded when the corpus was built."""
    data: dict[str, int] = json.loads((rollouts_path.parent / "manifest.json").read_text())
    return data


def peak_rss_kb() -> int:
    """This process's peak resident set (VmHWM), in KiB.

    Not ``ru_maxrss``: on Linux it survives ``exec``, so a child started by a big parent
    would report the parent's peak.
    """
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def peak_rss_mb_of(statements: str) -> float:
    """Peak RSS (MiB) of a fresh interpreter running ``statements`` (benchmarks importable)."""
    root = str(HERE.parent)
    report = "from benchmarks.corpus import peak_rss_kb; print(peak_rss_kb())"
    code = f"import sys; sys.path.insert(0, {root!r})\n{statements}\n{report}"
    env = {**os.environ, "PREFECT_HOME": tempfile.mkdtemp()}
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env)
    return int(done.stdout.strip().splitlines()[-1]) / 1024
