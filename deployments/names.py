"""Who owns which deployment names (no Prefect import: the command checks a name before any server).

``rollout-capture deploy --name X`` owns ``X``, its follower ``X-follow-runs`` (``follow-runs`` for
the default name), and the on-demand ``enrich-rollouts`` and ``prepare-dispatch``, on a work pool.
``rollout-capture serve --name X`` owns every name ending in :data:`SERVED_SUFFIX`: ``X-served`` and
its follower and on-demand ones, on no work pool, served by its process.
Neither takes over a deployment of the other's (a deployment on no work pool is a serve's); a
serve's Ctrl-C pauses its own deployments and disables their triggers, nothing else.
"""

from __future__ import annotations

SCHEDULED = "enrich-completed-runs"
ON_DEMAND = ("enrich-rollouts", "prepare-dispatch")
FOLLOW = "follow-runs"
"""The deployment following the started runs of a root: one per root, named after its scheduled one."""
SERVED_SUFFIX = "-served"
"""``serve`` registers deployments of its own under these names: it never touches (nor pauses on
Ctrl-C) one that ``rollout-capture deploy`` registered on a work pool, and ``deploy`` takes no
name ending so."""


def is_served_name(name: str) -> bool:
    """Whether ``name`` is one of serve's (``deploy`` refuses it)."""
    return name.endswith(SERVED_SUFFIX)


def follow_name(name: str) -> str:
    """The follower deployment beside the scheduled deployment ``name`` (its root's started runs)."""
    return FOLLOW if name == SCHEDULED else f"{name}-{FOLLOW}"
