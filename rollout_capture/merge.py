"""Merging captures into rollout records (spec section 7): the one-record entry point.

A merge adds exactly one key, ``ng_model_call_capture`` (and may update
``ng_agent_observations``, and rebuild the ``ng_trajectory`` and ``ng_perf`` NeMo Gym's collection
left: :mod:`rollout_capture.projections`), and merging twice gives the same record.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollout_capture.attachment import attach, build_attachment, payloads_to_read
from rollout_capture.evidence import rollout_evidence
from rollout_capture.identity import rollout_id_of
from rollout_capture.store import CaptureDir, as_store


def merge_model_call_capture_into_record(
    record: dict[str, Any], capture_dirs: Sequence[CaptureDir], include_payloads: bool = False
) -> dict[str, Any]:
    """Attach the rollout's captured calls to ``record`` in place and return it.

    A record without an id, or no capture dirs, is returned as is. Merging twice gives
    the same record.
    """
    if not capture_dirs:
        return record
    rollout_id = rollout_id_of(record)
    if rollout_id is None:
        return record
    evidence = rollout_evidence(rollout_id, [as_store(d) for d in capture_dirs])
    payloads = payloads_to_read(record, include_payloads)
    return attach(record, build_attachment(rollout_id, evidence, include_payloads=payloads))
