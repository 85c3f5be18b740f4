"""``EnrichOptions``: how one enrichment runs, the parameters every enriching flow takes flat (the
Prefect UI shows them), gathered once at the flow's top and handed down to the spool as one value."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollout_capture.quiescence import CAPTURE_DRAIN_TIMEOUT_S

Runner = Literal["threads", "processes", "dask", "ray"]
"""Where batches run: threads (default), a process pool (all cores), Dask or Ray (many machines)."""

DEFAULT_BATCH_SIZE = 1000
DEFAULT_MAX_WORKERS = 8


class EnrichOptions(BaseModel):
    """The enrichment's own parameters (not where its files are): how batches are cut, merged and
    run, what the input may hold, and the evidence thresholds its end state is judged by.

    Examples:
        ```python
        from rollout_capture.enrich_options import EnrichOptions

        options = EnrichOptions(batch_size=500, runner="processes", max_gap_share=0.05)
        print(options.batch_size, options.runner, options.include_payloads)  # 500 processes False
        ```
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    include_payloads: bool = False
    """Keep each call's request and response in the output."""
    quiescence_timeout_s: Annotated[float, Field(ge=0)] = CAPTURE_DRAIN_TIMEOUT_S
    """Seconds to wait, per batch, for calls still being written (live claims)."""
    batch_size: Annotated[int, Field(ge=1)] = DEFAULT_BATCH_SIZE
    """Rollout lines per batch task."""
    max_workers: Annotated[int, Field(ge=1)] = DEFAULT_MAX_WORKERS
    """Batches running at once, at most (threads: 2 on a local disk, and on an object store where
    they all read one journal, which the first reads for all)."""
    runner: Runner = "threads"
    dask_address: str | None = None
    ray_address: str | None = None
    strict: bool = False
    """Fail on a line that is not a rollout record instead of passing it through."""
    allow_empty: bool = False
    """Accept a capture dir that does not exist or holds nothing."""
    max_gap_share: Annotated[float, Field(ge=0, le=1)] | None = None
    """Above this share of rollouts with a gap, the run ends "Completed with gaps"."""
    max_failed_share: Annotated[float, Field(ge=0, le=1)] | None = None
    """Above this share of failed calls, the run ends "Completed with failed calls"."""
    otlp_endpoint: str | None = None
    """Send the output's traces to this OTLP/HTTP endpoint once it is written (the otel extra)."""
    otlp_headers_block: str | None = None
    """The Prefect ``Secret`` block holding that endpoint's headers: only its name is a parameter."""
    otlp_project: str | None = None
    """The project the traces land in (Phoenix's ``openinference.project.name``)."""
    otlp_run_name: str | None = None
    """What names the run in its trace ids (default: the output's location; see docs/contract.md 13)."""

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, Any]) -> EnrichOptions:
        """The options among a flow's parameters (its ``locals()`` at its top: the same names)."""
        return cls(**{name: parameters[name] for name in cls.model_fields if name in parameters})
