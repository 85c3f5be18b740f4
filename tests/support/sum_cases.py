"""Lists of numbers whose ``sum()`` Python >= 3.12 compensates, and their sums as Python 3.13 gives
them: ``tests/data/sums_py313.json`` is made by running this file with Python 3.13
(``python3.13 tests/support/sum_cases.py``), committed, and read by tests/test_summation.py on
every interpreter. Latencies as producers write them (two or three decimals), and the hard cases:
cancellation, magnitudes apart, ints before and among the floats, -0.0, inf and nan."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "data" / "sums_py313.json"


def encode(value: Any) -> Any:
    """A number as JSON keeps it exactly: floats as their hex, ints as they are."""
    return {"f": value.hex()} if type(value) is float else value


def decode(value: Any) -> Any:
    return float.fromhex(value["f"]) if isinstance(value, dict) else value


def cases(seed: int = 34) -> list[list[Any]]:
    rng = random.Random(seed)
    out: list[list[Any]] = [
        [3.55, 2.74, 3.19, 1.55],  # issue 34's rollout: 11.03, not 11.030000000000001
        [0.1] * 10,
        [1e16, 1.0, -1e16],
        [1e100, 1.0, -1e100, 1e-100],
        [-0.0],
        [-0.0, -0.0],
        [2, 0.5, 3, 0.25],
        [1, 2, 3],
        [float("inf"), 1.5, 2.5],
        [float("inf"), float("-inf")],
        [float("nan"), 1.0],
        [1.7976931348623157e308, 1.7976931348623157e308, -1.7976931348623157e308],
        [2**62, 2**62, 0.5],
        [],
    ]
    for _ in range(240):
        kind = rng.randrange(5)
        n = rng.randint(1, 16)
        if kind == 0:  # latencies in ms, as producers round them
            values: list[Any] = [round(rng.uniform(0.0, 5000.0), rng.choice((2, 3))) for _ in range(n)]
        elif kind == 1:  # small ones, where the last bits show
            values = [round(rng.uniform(0.0, 10.0), 2) for _ in range(n)]
        elif kind == 2:  # magnitudes far apart, both signs
            values = [rng.choice((-1, 1)) * 10.0 ** rng.randint(-20, 20) * rng.random() for _ in range(n)]
        elif kind == 3:  # ints first and among the floats
            values = [
                rng.randint(0, 1000) if rng.random() < 0.3 else round(rng.uniform(0, 50), 2) for _ in range(n)
            ]
        else:  # cancelling pairs
            base = [rng.uniform(-1e6, 1e6) for _ in range(n)]
            values = base + [-v for v in base[: n // 2]] + [rng.random()]
            rng.shuffle(values)
        out.append(values)
    return out


def main() -> None:
    assert sys.version_info[:2] == (3, 13), "made with Python 3.13's own sum()"
    data = {
        "python": sys.version.split()[0],
        "cases": [{"values": [encode(v) for v in values], "sum": encode(sum(values))} for values in cases()],
    }
    OUT.write_text(json.dumps(data, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
