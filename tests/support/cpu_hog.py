"""Run a command beside a CPU hog that keeps every core busy: the suite must not fail by chance
on a loaded machine (``make test-stress``; ``python -m tests.support.cpu_hog COMMAND...``).

The hog is one busy process per core (``ROLLOUT_CAPTURE_HOG_PROCESSES`` sets how many), at the
command's own priority; each stops with the command, and by itself if this process dies.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time


def _spin(parent: int) -> None:
    """Busy until the process that started it is gone (checked every ~0.1 s of spinning)."""
    while os.getppid() == parent:
        deadline = time.monotonic() + 0.1
        while time.monotonic() < deadline:
            pass


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m tests.support.cpu_hog COMMAND [ARG...]", file=sys.stderr)
        return 2
    count = int(os.environ.get("ROLLOUT_CAPTURE_HOG_PROCESSES") or os.cpu_count() or 2)
    spawn = multiprocessing.get_context("spawn")
    hogs = [spawn.Process(target=_spin, args=(os.getpid(),), daemon=True) for _ in range(count)]
    for hog in hogs:
        hog.start()
    print(f"cpu_hog: {count} busy processes beside: {' '.join(argv)}", file=sys.stderr, flush=True)
    try:
        return subprocess.call(argv)
    finally:
        for hog in hogs:
            hog.terminate()
        for hog in hogs:
            hog.join()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
