"""Run folders written for tests: on a local disk or as objects on the S3 endpoint."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import orjson

from rollout_capture import CaptureStore
from rollout_capture.run_folders import RunFolder, RunsRoot

from ..conftest import S3

ROW = {"model_call_id": "c", "dialect": "chat", "response": {"usage": {"prompt_tokens": 3}}}


def make_run(root: Path, name: str, *, finished: bool, rollouts: int = 3, enriched: bool = False) -> Path:
    """A run folder on disk: rollouts, one captured call each, ``_SUCCESS`` when finished."""
    run = root / name
    (run / "captures").mkdir(parents=True)
    store = CaptureStore(run / "captures")
    lines = []
    for task in range(rollouts):
        store.record(f"{task}-0", ROW)
        lines.append(orjson.dumps({"_ng_task_index": task, "_ng_rollout_index": 0}))
    (run / "rollouts.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    if finished:
        (run / "_SUCCESS").write_bytes(b"")
    if enriched:
        (run / "_ENRICHED").write_bytes(b"{}")
    return run


def run_objects(prefix: str, name: str, *, finished: bool, enriched: bool = False) -> dict[str, bytes]:
    """The objects of a run folder (object-layout captures), to write with one ``pipe``."""
    objects = {
        f"{prefix}/{name}/rollouts.jsonl": orjson.dumps({"_ng_task_index": 0, "_ng_rollout_index": 0})
        + b"\n",
        f"{prefix}/{name}/captures/0-0.capture/000000000000.json": orjson.dumps(ROW),
    }
    if finished:
        objects[f"{prefix}/{name}/_SUCCESS"] = b""
    if enriched:
        objects[f"{prefix}/{name}/_ENRICHED"] = b"{}"
    return objects


class Where:
    """A runs root on a local disk or on S3, and how to reach its run folders."""

    def __init__(self, tmp_path: Path, s3: S3 | None) -> None:
        self.s3 = s3
        self.local = tmp_path / "runs"
        self.url = s3.url("runs") if s3 is not None else str(self.local)
        self.options: dict[str, Any] | None = s3.storage_options if s3 is not None else None

    def make_run(self, name: str, *, finished: bool = True, rollouts: int = 3) -> None:
        path = make_run(self.local, name, finished=finished, rollouts=rollouts)
        if self.s3 is not None:
            self.s3.fs().put(str(path), f"{self.s3.bucket}/runs/{name}", recursive=True)

    def delete_run(self, name: str) -> None:
        """The run folder gone, as ``rm -r`` (or a store's recursive delete) leaves it."""
        shutil.rmtree(self.local / name)
        if self.s3 is not None:
            self.s3.fs().rm(f"{self.s3.bucket}/runs/{name}", recursive=True)

    def root(self) -> RunsRoot:
        return RunsRoot(self.url, self.options)

    def run(self, name: str) -> RunFolder:
        return next(r for r in self.root().runs() if r.name == name)

    def names(self, run: str) -> set[str]:
        """The names directly in a run folder, listed now."""
        if self.s3 is None:
            return {p.name for p in (self.local / run).iterdir()}
        return {p.rsplit("/", 1)[-1] for p in self.s3.fs().ls(f"{self.s3.bucket}/runs/{run}", detail=False)}

    def read(self, run: str, name: str) -> bytes:
        if self.s3 is None:
            return (self.local / run / name).read_bytes()
        return bytes(self.s3.fs().cat_file(f"{self.s3.bucket}/runs/{run}/{name}"))

    def capture_store(self, run: str) -> CaptureStore:
        if self.s3 is None:
            return CaptureStore(self.local / run / "captures")
        return CaptureStore(f"{self.url}/{run}/captures", storage_options=self.options)
