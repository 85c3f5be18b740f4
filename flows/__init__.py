"""Prefect flows: clearing before dispatch, enriching rollouts, scheduled enrichment of runs,
following a run while it runs, compacting finished runs.

Imported lazily, so commands that need no Prefect (``rollout-capture proxy``) start fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollout_capture.flows.compact import compact_capture_dirs
    from rollout_capture.flows.dispatch import prepare_dispatch
    from rollout_capture.flows.enrich import enrich_rollouts
    from rollout_capture.flows.enrich_runs import enrich_completed_runs
    from rollout_capture.flows.follow import follow_run

__all__ = [
    "compact_capture_dirs",
    "enrich_completed_runs",
    "enrich_rollouts",
    "follow_run",
    "prepare_dispatch",
]

_WHERE = {
    "compact_capture_dirs": "rollout_capture.flows.compact",
    "prepare_dispatch": "rollout_capture.flows.dispatch",
    "enrich_rollouts": "rollout_capture.flows.enrich",
    "enrich_completed_runs": "rollout_capture.flows.enrich_runs",
    "follow_run": "rollout_capture.flows.follow",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module rollout_capture.flows has no attribute {name!r}")
