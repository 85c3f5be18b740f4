"""One sum of numbers, equal bit for bit to CPython >= 3.12's built-in ``sum()`` on every Python we
support.

NeMo Gym sums call metrics with ``sum()``, which adds floats with Neumaier's compensation from
Python 3.12 on (``sum([3.55, 2.74, 3.19, 1.55])`` is ``11.03`` there, ``11.030000000000001`` on
3.11). Our figures must be NeMo Gym's whatever interpreter enriches, so on 3.11 the same algorithm
runs here, step for step as ``builtin_sum_impl`` in CPython's ``Python/bltinmodule.c`` (3.12, 3.13):
ints summed exactly until the first float, then floats compensated, ints in the float phase added
plainly, anything else by ``+`` from there on. On 3.12 and later it is ``sum`` itself.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable
from typing import Any

_LONG_MIN = -(2**63)
_LONG_MAX = 2**63 - 1
"""A C ``long`` (LP64): the range ``sum()``'s fast paths take an int in."""


def neumaier_sum(values: Iterable[Any]) -> Any:
    """``sum(values)`` as CPython >= 3.12 computes it, on any interpreter (its fast paths, then ``+``)."""
    items = iter(values)
    result: Any = 0
    # The int phase: exact while the running sum and each item fit a C long.
    for item in items:
        if (type(item) is int or type(item) is bool) and (
            _LONG_MIN <= item <= _LONG_MAX and _LONG_MIN <= result + item <= _LONG_MAX
        ):
            result += item
            continue
        result = result + item  # leaves the int phase (a float, an overflow, another type)
        break
    else:
        return result
    if type(result) is not float:
        return _plain(result, items)
    # The float phase: Neumaier's compensated sum.
    total: float = result
    compensation = 0.0
    for item in items:
        if type(item) is float:
            t = total + item
            if abs(total) >= abs(item):
                compensation += (total - t) + item
            else:
                compensation += (item - t) + total
            total = t
            continue
        if isinstance(item, int) and _LONG_MIN <= item <= _LONG_MAX:
            total += float(item)
            continue
        if compensation and math.isfinite(compensation):
            total += compensation
        return _plain(total + item, items)
    if compensation and math.isfinite(compensation):
        total += compensation
    return total


def _plain(result: Any, items: Iterable[Any]) -> Any:
    """The rest of ``sum()``: each item added by ``+`` (no fast path once one was left)."""
    for item in items:
        result = result + item
    return result


exact_sum: Callable[[Iterable[Any]], Any] = sum if sys.version_info >= (3, 12) else neumaier_sum
"""The sum every figure NeMo Gym sums is taken with (metrics, metrics by owner, verifier metrics)."""
