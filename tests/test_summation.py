"""One summation equal to CPython >= 3.12's ``sum()`` on every interpreter (issue 34, item 2):
checked against sums Python 3.13 itself computed (tests/data/sums_py313.json, made by
tests/support/sum_cases.py), and wherever NeMo Gym sums: the rollout's metrics, the owners'
and each verifier invocation's."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_capture.metrics import aggregate_call_dicts
from rollout_capture.summation import exact_sum, neumaier_sum

from .support.sum_cases import OUT, cases, decode

RECORDED = json.loads(Path(OUT).read_text())


def same(a: Any, b: Any) -> bool:
    """Equal as numbers bit for bit (nan equal to nan; -0.0 apart from 0.0; an int apart from a float)."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return a.hex() == b.hex() or (math.isnan(a) and math.isnan(b))
    return bool(a == b)


def test_the_recorded_cases_are_the_generated_ones() -> None:
    """The committed file was made from these very lists (by Python 3.13: its own ``sum()``)."""
    assert RECORDED["python"].startswith("3.13.")
    recorded = [[decode(v) for v in case["values"]] for case in RECORDED["cases"]]
    assert len(recorded) == len(cases()) > 250
    for got, made in zip(recorded, cases(), strict=True):
        assert all(same(x, y) for x, y in zip(got, made, strict=True))


@pytest.mark.parametrize("index", range(len(RECORDED["cases"])))
def test_our_sum_is_python_3_13s_on_every_recorded_list(index: int) -> None:
    case = RECORDED["cases"][index]
    values = [decode(v) for v in case["values"]]
    expected = decode(case["sum"])
    assert same(neumaier_sum(values), expected), values
    assert same(exact_sum(values), expected), values


def test_the_issue_rollout_sums_to_nemo_gyms_figure() -> None:
    """3.55 + 2.74 + 3.19 + 1.55: NeMo Gym (Python 3.13) says 11.03; left to right, 11.030000000000001."""
    assert exact_sum([3.55, 2.74, 3.19, 1.55]) == 11.03
    assert 3.55 + 2.74 + 3.19 + 1.55 == 11.030000000000001  # what a plain loop gave before


numbers = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(0, 1e5).map(lambda x: round(x, 2)),
    st.integers(-(2**70), 2**70),
    st.booleans(),
)


@pytest.mark.skipif(sys.version_info < (3, 12), reason="compares with this interpreter's compensated sum()")
@given(st.lists(numbers, max_size=12))
@settings(max_examples=2000, deadline=None)
def test_our_sum_is_this_interpreters_sum_on_any_list(values: list[Any]) -> None:
    """Where ``sum()`` compensates (3.12+; `make test-nemo-gym`'s Python 3.13 runs the fast tier too)."""
    try:
        expected = sum(values)
    except OverflowError:
        with pytest.raises(OverflowError):
            neumaier_sum(values)
        return
    assert same(neumaier_sum(values), expected)


def _call(latency: float | None, verifier: str | None = None) -> dict[str, Any]:
    call: dict[str, Any] = dict.fromkeys(
        ("tokens_in", "tokens_out", "tokens_reasoning", "tokens_total", "cached_tokens")
    )
    return {**call, "latency_total_ms": latency, "verifier_invocation_id": verifier}


def test_metrics_sum_latencies_as_nemo_gym_does() -> None:
    calls = [_call(3.55), _call(2.74), _call(None), _call(3.19), _call(1.55)]
    assert aggregate_call_dicts(calls)["latency_total_ms"] == 11.03
    assert aggregate_call_dicts([_call(None)])["latency_total_ms"] is None  # unknown stays null
    assert aggregate_call_dicts([])["latency_total_ms"] is None
