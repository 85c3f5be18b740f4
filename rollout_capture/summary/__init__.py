"""What a run's evidence says, counted: failed calls, latency, tokens, models, gaps, orphans.

An :class:`EvidenceSummary` is built one enriched record at a time (:meth:`~EvidenceSummary.add`)
and batches are summed (:meth:`~EvidenceSummary.merge`), so a flow never keeps its records; the
batch path counts its attachments in bulk with :class:`AttachmentFold`, the same counts.

This package's face is the names below; each lives in the module of its job: ``sketch`` (the
bounded quantile sketch), ``checks`` (what is read of a call, checked), ``evidence`` (the
summary and its models), ``fold`` (counting in bulk), ``orphans``, ``files`` (enriched JSONL).
"""

from rollout_capture.summary.checks import (
    CALL_FIELDS,
    NO_STATUS,
    OTHER_MODELS,
    TOKEN_SUMS,
    UNKNOWN_MODEL,
    EvidenceShapeError,
    attachment_of,
    count_field,
    gap_codes,
    is_failed,
    model_of,
    number_field,
    observation_gap_codes,
    status_class,
    text_field,
)
from rollout_capture.summary.evidence import (
    FAIL_SHARE_WARN,
    MAX_EXAMPLES,
    MAX_MODELS,
    MAX_ROWS,
    EvidenceSummary,
    ModelStats,
    TokenSums,
    figure,
    shorten,
    tokens_text,
    top_counts,
    unknown_calls_note,
)
from rollout_capture.summary.files import (
    iter_enriched,
    no_attachment_error,
    summarize_file,
    summarize_records,
)
from rollout_capture.summary.fold import AttachmentFold
from rollout_capture.summary.orphans import capture_ids_from_names, near_input_id, orphans
from rollout_capture.summary.sketch import EXACT_LIMIT, GAMMA, PERCENTILES, Histogram, Sketch

__all__ = [
    "CALL_FIELDS",
    "EXACT_LIMIT",
    "FAIL_SHARE_WARN",
    "GAMMA",
    "MAX_EXAMPLES",
    "MAX_MODELS",
    "MAX_ROWS",
    "NO_STATUS",
    "OTHER_MODELS",
    "PERCENTILES",
    "TOKEN_SUMS",
    "UNKNOWN_MODEL",
    "AttachmentFold",
    "EvidenceShapeError",
    "EvidenceSummary",
    "Histogram",
    "ModelStats",
    "Sketch",
    "TokenSums",
    "attachment_of",
    "capture_ids_from_names",
    "count_field",
    "figure",
    "gap_codes",
    "is_failed",
    "iter_enriched",
    "model_of",
    "near_input_id",
    "no_attachment_error",
    "number_field",
    "observation_gap_codes",
    "orphans",
    "shorten",
    "status_class",
    "summarize_file",
    "summarize_records",
    "text_field",
    "tokens_text",
    "top_counts",
    "unknown_calls_note",
]
