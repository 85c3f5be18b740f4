"""Prefect flows: clearing before dispatch, enriching rollouts, scheduled enrichment of runs.

Imported lazily, so commands that need no Prefect (``rollout-capture proxy``) start fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flows.dispatch import prepare_dispatch
    from flows.enrich import enrich_rollouts
    from flows.enrich_runs import enrich_completed_runs

__all__ = ["enrich_completed_runs", "enrich_rollouts", "prepare_dispatch"]

_WHERE = {
    "prepare_dispatch": "flows.dispatch",
    "enrich_rollouts": "flows.enrich",
    "enrich_completed_runs": "flows.enrich_runs",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'flows' has no attribute {name!r}")
