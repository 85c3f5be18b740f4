"""Regenerate ``rollout_capture/sample/`` (package data) from the shared corpus, byte for byte.

    python examples/build_sample.py [--corpus ../shared/corpus/nemo-gym-example-rollouts]

The sample covers every case the demo should show: the three dialects, both layouts,
a verifier with its judge call, agent observations, a damaged row, an incomplete
marker, a rollout with no capture, a retry attempt, a record with no id and a line of
the corpus that is not JSON.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.samples import capture_rows, iter_corpus, jsonl_bytes
from rollout_capture.names import jsonl_name, marker_name, object_name

HERE = Path(__file__).resolve().parent
DEFAULT_CORPUS = HERE.parent.parent / "shared" / "corpus" / "nemo-gym-example-rollouts"
SOURCES = [  # (corpus file, dialect)
    ("environments__blackjack.jsonl", "responses"),
    ("resources_servers__math_with_judge.jsonl", "responses"),
    ("environments__workplace_assistant.jsonl", "responses"),
    ("resources_servers__example_tool_call_multireward.jsonl", "chat"),
    ("resources_servers__gpqa_diamond.jsonl", "chat"),
    ("environments__prime_agent_math.jsonl", "chat"),
    ("environments__instruction_following.jsonl", "messages"),
    ("resources_servers__deepswe.jsonl", "messages"),
    ("resources_servers__equivalence_llm_judge.jsonl", "messages"),
    ("environments__calendar.jsonl", "responses"),  # a real record whose server sent no usage
]


def _first_record(corpus: Path, name: str) -> dict[str, Any]:
    for file, _, line in iter_corpus(corpus):
        if file == name:
            record = orjson.loads(line)
            if isinstance(record, dict) and isinstance(record.get("response"), dict):
                return record
    raise SystemExit(f"{name}: no usable record in {corpus}")


def build(corpus: Path, out: Path) -> None:
    captures = out / "captures"
    if out.exists():
        shutil.rmtree(out)
    captures.mkdir(parents=True)
    lines: list[bytes] = []
    for task, (name, dialect) in enumerate(SOURCES):
        record = _first_record(corpus, name)
        record = {k: v for k, v in record.items() if not k.startswith("_ng_")}
        record["_ng_task_index"], record["_ng_rollout_index"] = task, 0
        rollout_id = f"{task}-0"
        if task == 9:  # a retry: its capture key carries the attempt
            record["_ng_attempt_index"] = 1
            rollout_id = f"{task}-0-a1"
        rows = capture_rows(record, rollout_id, dialect=dialect, verifier=task == 1)  # type: ignore[arg-type]
        if task == 2:  # the agent says which invocation made which call
            record["ng_agent_observations"] = {
                "source": "example_agent",
                "invocations": [
                    {
                        "invocation_id": "root",
                        "model_calls": [{"model_call_id": r["model_call_id"]} for r in rows[:1]],
                    }
                ],
                "gaps": [],
            }
        if task == 5:  # the object layout, as an object-store writer leaves it
            for seq, row in enumerate(rows):
                path = captures / object_name(rollout_id, seq)
                path.parent.mkdir(exist_ok=True)
                path.write_bytes(orjson.dumps(row))
        elif task == 8:  # no capture at all for this rollout
            pass
        else:
            data = jsonl_bytes(rows)
            if task == 3:  # a writer died mid-line
                data += b'{"model_call_id": "torn", "dialect": "ch'
            (captures / jsonl_name(rollout_id)).write_bytes(data)
        if task == 6:  # a row could not be written
            (captures / marker_name(rollout_id)).write_bytes(b"")
        lines.append(orjson.dumps(record))
    lines.append(b"<PLACEHOLDER ROW>")  # real bad input, as found in the corpus
    lines.append(orjson.dumps({"note": "a record with no rollout id is passed through untouched"}))
    (out / "rollouts.jsonl").write_bytes(b"\n".join(lines) + b"\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--out", type=Path, default=HERE.parent / "rollout_capture" / "sample")
    args = parser.parse_args()
    build(args.corpus, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
