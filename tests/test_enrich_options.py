"""``EnrichOptions``: the flows' flat parameters and the one value they hand down agree."""

from __future__ import annotations

import inspect

import pytest
from pydantic import ValidationError

from rollout_capture.enrich_options import EnrichOptions


def test_each_option_has_the_default_of_the_flows_that_take_it() -> None:
    """A flow's signature (what the Prefect UI shows) and the model cannot drift apart: every
    option a flow takes has the same default there as on the model."""
    from rollout_capture.flows import enrich_completed_runs, enrich_rollouts

    for flow in (enrich_rollouts, enrich_completed_runs):
        parameters = inspect.signature(flow.fn).parameters
        taken = [name for name in EnrichOptions.model_fields if name in parameters]
        assert len(taken) >= 10, (flow.name, taken)
        for name in taken:
            assert parameters[name].default == EnrichOptions.model_fields[name].default, (flow.name, name)


def test_from_parameters_takes_the_options_and_leaves_the_rest() -> None:
    given = {"rollouts": "r.jsonl", "capture_dir": "caps", "batch_size": 5, "runner": "processes"}
    options = EnrichOptions.from_parameters(given)
    assert options.batch_size == 5 and options.runner == "processes"
    assert options == EnrichOptions(batch_size=5, runner="processes")


@pytest.mark.parametrize(
    "bad", [{"batch_size": 0}, {"max_gap_share": 1.5}, {"runner": "slurm"}, {"other": 1}]
)
def test_bad_options_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        EnrichOptions(**bad)  # type: ignore[arg-type]


def test_options_are_frozen() -> None:
    with pytest.raises(ValidationError):
        EnrichOptions().batch_size = 2  # type: ignore[misc]
