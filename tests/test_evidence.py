"""Which store speaks for a rollout (spec 7): one rollout's read against the batch reader's.

:func:`rollout_evidence` (the per-record API's read) follows :class:`EvidenceReader`'s rule
(the reference): the first store holding anything wins, a store that cannot be read makes
the rollout unreadable, a transient fault is raised. These tests prove the two agree.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from rollout_capture import CaptureStore
from rollout_capture.evidence import Evidence, EvidenceReader, gather_evidence, rollout_evidence

ROW = {"model_call_id": "c", "dialect": "responses", "status_code": 200, "response": {"id": "x"}}


class _Broken(CaptureStore):
    """A store whose reads fail the way a misconfigured root does (not transient)."""

    def prefetch(self, rollout_ids: Any, *, scope: Any = None) -> Any:
        raise PermissionError("no access")


def _stores(tmp_path: Path) -> dict[str, CaptureStore]:
    empty = CaptureStore(tmp_path / "empty")
    holding = CaptureStore(tmp_path / "holding")
    holding.record("r-1", ROW)
    other = CaptureStore(tmp_path / "other")
    other.record("r-1", {**ROW, "model_call_id": "d"})
    other.mark_incomplete("r-1")
    return {"empty": empty, "holding": holding, "other": other, "broken": _Broken(tmp_path / "broken")}


def _seen(evidence: Evidence) -> tuple[Any, ...]:
    snap = evidence.snapshot
    if snap is None:
        return (evidence.unreadable, None)
    return (evidence.unreadable, snap.found, snap.incomplete, snap.rows, len(snap.damaged), snap.claims)


@pytest.mark.parametrize("count", [1, 2, 3])
def test_one_rollouts_read_agrees_with_the_batch_reader(tmp_path: Path, count: int) -> None:
    stores = _stores(tmp_path)
    for names in itertools.permutations(stores, count):
        chosen = [stores[name] for name in names]
        for rollout_id in ("r-1", "r-2"):
            expected = EvidenceReader([rollout_id], chosen).evidence(rollout_id)
            assert _seen(rollout_evidence(rollout_id, chosen)) == _seen(expected), names
            assert _seen(gather_evidence([rollout_id], chosen)[rollout_id]) == _seen(expected), names


def test_a_transient_fault_is_raised_by_both(tmp_path: Path) -> None:
    class Flaky(CaptureStore):
        def prefetch(self, rollout_ids: Any, *, scope: Any = None) -> Any:
            raise TimeoutError("slow down")

    flaky = Flaky(tmp_path)
    with pytest.raises(TimeoutError):
        EvidenceReader(["r-1"], [flaky])
    with pytest.raises(TimeoutError):
        rollout_evidence("r-1", [flaky])
