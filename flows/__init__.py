"""Prefect flows: clearing before dispatch, enriching rollouts, scheduled enrichment of runs."""

from flows.dispatch import prepare_dispatch
from flows.enrich import enrich_rollouts
from flows.enrich_runs import enrich_completed_runs

__all__ = ["enrich_completed_runs", "enrich_rollouts", "prepare_dispatch"]
