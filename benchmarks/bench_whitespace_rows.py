"""What a whitespace row costs (contract section 4, issue 46): its line, and the peak memory of
writing it and of reading it, for a verify call whose answer is ``--answer-mb`` MB of text; and
what reading a rollout beside a row that inflates to ``--bomb-mib`` MiB costs.

    python benchmarks/bench_whitespace_rows.py [--answer-mb 40] [--bomb-mib 512] [--baseline REF]

Each figure is measured in a process of its own (peak RSS over what it held before, from
``ru_maxrss``), for this tree and, with ``--baseline`` (a git ref of this repository, or a
checkout's directory), for the code before: before and after in one run. Prints JSON. A
baseline that holds a bomb whole may take gigabytes: ``--bomb-mib 0`` leaves it out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, os, random, resource, sys, time
tree, mode, path, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
sys.path.insert(0, tree)


def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


if mode == "write":
    from rollout_capture.whitespace_rows import whitespace_line

    rng = random.Random(1)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(5000)]
    text = " ".join(rng.choices(words, k=size // 4))[:size]
    row = {"kind": "verifier_invocation", "verifier_invocation_id": "v", "response": {"text": text}}
    del text
    before, started = peak_mb(), time.perf_counter()
    line = whitespace_line(row)
    took = time.perf_counter() - started
    with open(path, "wb") as out:
        out.write(b'{"model_call_id":"p","dialect":"chat"}\n' + line)
    figures = {"line_mb": len(line) / 1e6, "peak_over_mb": peak_mb() - before, "s": took}
else:
    from rollout_capture import merge_model_call_capture_into_record

    before, started = peak_mb(), time.perf_counter()
    record = {"_ng_task_index": 0, "_ng_rollout_index": 0}
    capture = merge_model_call_capture_into_record(record, [os.path.dirname(path)])["ng_model_call_capture"]
    figures = {
        "peak_over_mb": peak_mb() - before,
        "s": time.perf_counter() - started,
        "calls": len(capture["calls"]),
        "verifier_invocations": len(capture.get("verifier_invocations", [])),
        "gaps": capture.get("gaps", []),
    }
print(json.dumps(figures))
"""


def measure(tree: Path, mode: str, path: Path, size: int) -> dict[str, object]:
    """One figure, in a fresh interpreter importing ``rollout_capture`` from ``tree``."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tree), mode, str(path), str(size)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]}
    figures: dict[str, object] = json.loads(done.stdout)
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in figures.items()}


def tree_of(baseline: str, scratch: Path) -> Path:
    """A checkout's directory as it is, or a git ref unpacked from ``git archive``."""
    if Path(baseline).is_dir():
        return Path(baseline).resolve()
    target = scratch / "baseline"
    target.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", baseline], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--answer-mb", type=float, default=40.0, help="the verify answer's text, MB")
    parser.add_argument("--bomb-mib", type=int, default=512, help="what the bomb inflates to (0: none)")
    parser.add_argument("--baseline", default=None, help="the code before: a git ref or a checkout")
    args = parser.parse_args()
    from tests.support.hostile_rows import inflating_row

    results: dict[str, object] = {"answer_mb": args.answer_mb, "bomb_mib": args.bomb_mib}
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        trees = {"this": ROOT}
        if args.baseline:
            trees["baseline"] = tree_of(args.baseline, scratch)
        for name, tree in trees.items():
            row = scratch / name / "row"
            row.mkdir(parents=True)
            path = row / "0-0.capture.jsonl"
            figures: dict[str, object] = {
                "write": measure(tree, "write", path, int(args.answer_mb * 1e6)),
                "read": measure(tree, "read", path, 0),
            }
            if args.bomb_mib:
                bomb = scratch / name / "bomb"
                bomb.mkdir()
                version = "rcw1"  # a row of the first version: what captures already hold
                line = inflating_row(args.bomb_mib, version)
                (bomb / "0-0.capture.jsonl").write_bytes(b'{"model_call_id":"p","dialect":"chat"}\n' + line)
                figures["bomb_line_mb"] = round(len(line) / 1e6, 2)
                figures["bomb_read"] = measure(tree, "read", bomb / "0-0.capture.jsonl", 0)
            results[name] = figures
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
