"""Model calls no rollout names: forwarded uncaptured, and never in silence.

A model call without the ``/ng-rollout/<id>`` prefix cannot be filed under a rollout, so a
producer forwards it and writes nothing. Where every call arrives so (NeMo Gym's agents send the
prefix only while its ``observability_enabled`` is true; a proxy behind NeMo Gym's model server
sees none, that server strips it), a run would end with no captures and no word: so the first
such call is a warning at once, naming its path, again at 10, 100, 1,000..., and the count by path
when the producer stops.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

from rollout_capture.producer.routing import CAPTURED_PATHS, Route

logger = logging.getLogger("rollout_capture.producer")

_WHY = (
    "no rollout names it: a client must call .../ng-rollout/<rollout_id>/v1/... (NeMo Gym's agents add "
    "the prefix only while observability_enabled is true; a producer behind NeMo Gym's model server sees "
    "none, that server strips it: capture on the model server itself, see docs/nemo-gym.md)"
)


class UnfiledCalls:
    """Counts the model calls a producer forwarded without a rollout, and says so."""

    def __init__(self, where: str) -> None:
        self._where = where
        self._lock = threading.Lock()  # the middleware's app may run on several threads' loops
        self.counts: Counter[str] = Counter()

    def saw(self, method: str, found: Route) -> None:
        """Note a request if it is a model call without a rollout (warned at 1, 10, 100...)."""
        if found.rollout_id is not None or method != "POST" or found.path not in CAPTURED_PATHS:
            return
        with self._lock:
            self.counts[found.path] += 1
            total = sum(self.counts.values())
        if _power_of_ten(total):
            logger.warning(
                "%s: %d model call(s) forwarded uncaptured, the last POST %s: %s",
                self._where,
                total,
                found.path,
                _WHY,
            )

    def report(self) -> None:
        """At shutdown: how many calls went uncaptured, by path (nothing when there were none)."""
        with self._lock:
            counts = dict(self.counts)
        if counts:
            shown = ", ".join(f"{path} {count}" for path, count in sorted(counts.items()))
            logger.warning(
                "%s stopping: %d model call(s) were forwarded uncaptured (%s): %s",
                self._where,
                sum(counts.values()),
                shown,
                _WHY,
            )


def _power_of_ten(n: int) -> bool:
    while n % 10 == 0:
        n //= 10
    return n == 1
