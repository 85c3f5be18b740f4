"""rollout-capture core: capture stores, call records and merging, with no Prefect import.

Data flows one way: URL -> store -> rows -> call records -> attachment -> record.
"""

# The one source of the version: pyproject.toml reads it (``[tool.setuptools.dynamic]``).
__version__ = "0.2.0"

from rollout_capture.attachment import ATTACHMENT_KEY, attach, build_attachment
from rollout_capture.call_records import (
    ModelCallRecord,
    ModelServerRef,
    VerifierInvocation,
    VerifierRef,
    build_model_call_record,
    extract_token_stats,
)
from rollout_capture.claims import Claim
from rollout_capture.clear import clear_model_call_captures_for_rollouts, rollout_ids_of
from rollout_capture.config import (
    ModelCallCaptureConfig,
    model_call_capture_dirs_from_config,
    observability_enabled_from_config,
)
from rollout_capture.evidence import Evidence, gather_evidence
from rollout_capture.faults import is_transient_storage_error
from rollout_capture.identity import maybe_rollout_id_from_run_body, validate_rollout_id
from rollout_capture.merge import merge_model_call_capture_into_record
from rollout_capture.quiescence import (
    CAPTURE_DRAIN_TIMEOUT_S,
    await_model_call_capture_quiescence,
    await_quiescence_many,
)
from rollout_capture.read_calls import (
    aggregate_model_call_metrics,
    aggregate_model_call_records,
    read_available_model_call_records,
    read_model_call_records,
)
from rollout_capture.rows import CaptureRowError, Damage
from rollout_capture.snapshot import RolloutSnapshot
from rollout_capture.store import CaptureDir, CaptureStore

__all__ = [
    "ATTACHMENT_KEY",
    "CAPTURE_DRAIN_TIMEOUT_S",
    "CaptureDir",
    "CaptureRowError",
    "CaptureStore",
    "Claim",
    "Damage",
    "Evidence",
    "ModelCallCaptureConfig",
    "ModelCallRecord",
    "ModelServerRef",
    "RolloutSnapshot",
    "VerifierInvocation",
    "VerifierRef",
    "aggregate_model_call_metrics",
    "aggregate_model_call_records",
    "attach",
    "await_model_call_capture_quiescence",
    "await_quiescence_many",
    "build_attachment",
    "build_model_call_record",
    "clear_model_call_captures_for_rollouts",
    "extract_token_stats",
    "gather_evidence",
    "is_transient_storage_error",
    "maybe_rollout_id_from_run_body",
    "merge_model_call_capture_into_record",
    "model_call_capture_dirs_from_config",
    "observability_enabled_from_config",
    "read_available_model_call_records",
    "read_model_call_records",
    "rollout_ids_of",
    "validate_rollout_id",
]
