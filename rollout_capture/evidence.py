"""Which store speaks for a rollout, and what it holds (spec section 7, "the store used").

The first store holding anything for an id wins. Transient storage faults are raised so
the caller can retry; a store unreadable for any other reason marks its rollouts so.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from rollout_capture.faults import is_transient_storage_error
from rollout_capture.snapshot import RolloutSnapshot
from rollout_capture.store import CaptureStore

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Evidence:
    """What the stores say about one rollout: its snapshot, or that it could not be read."""

    snapshot: RolloutSnapshot | None
    unreadable: bool = False


def gather_evidence(rollout_ids: Sequence[str], stores: Sequence[CaptureStore]) -> dict[str, Evidence]:
    """For each id, the snapshot from the first store holding anything for it.

    Raises transient storage faults; a store that cannot be read for another reason
    makes its rollouts ``unreadable``.
    """
    out: dict[str, Evidence] = {}
    remaining = list(dict.fromkeys(rollout_ids))
    for store in stores:
        if not remaining:
            break
        try:
            snapshots = store.snapshots(remaining)
        except Exception as exc:
            if is_transient_storage_error(exc):
                raise
            logger.warning("could not read captures in %s: %s", store.url, exc)
            for rollout_id in remaining:
                out[rollout_id] = Evidence(None, unreadable=True)
            return out
        still: list[str] = []
        for rollout_id in remaining:
            snap = snapshots.get(rollout_id)
            if snap is not None and snap.found:
                out[rollout_id] = Evidence(snap)
            else:
                still.append(rollout_id)
        remaining = still
    for rollout_id in remaining:
        out[rollout_id] = Evidence(None)
    return out
