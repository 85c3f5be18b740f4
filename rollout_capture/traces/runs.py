"""What names a run of traces, and the project it lands in (docs/contract.md, section 13).

Trace ids hash the project and the run with the rollout id (:mod:`.ids`): NeMo Gym's rollout ids
repeat in every run, so the run must tell two runs apart, and stay the same when one run is
exported again. A run is named, in this order:

- explicitly (``--otlp-run-name``, ``otlp_run_name=``): the user's own name for it;
- under ``enrich-runs``, by its run folder: ``<name>/<folder>`` when the runs are named, else
- by its enriched output's absolute location (a local path made absolute, a URL as it is).

The output's location is the default because it is what every way of exporting a run knows
alike: the flow exporting the file it just wrote and a later ``rollout-capture export`` of that
file give the same ids (nothing doubled), while another run, written elsewhere, never does.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from rollout_capture.filesystem import absolute_location, local_path
from rollout_capture.secret_options import bare_url

MAX_NAME = 512
"""Characters a project or run name may have (Phoenix shows both; ids hash them whole)."""
DEFAULT_PROJECT = "rollout-capture"
"""The project of a runs root whose path has no name of its own (``/``)."""


def check_name(value: str | None, what: str) -> str | None:
    """A project or run name as given, or ``ValueError`` naming ``what``: not blank, no control
    character (a NUL would blur the parts an id hashes), at most :data:`MAX_NAME` characters."""
    if value is None:
        return None
    if not value.strip():
        raise ValueError(f"{what}: a name must not be blank")
    if len(value) > MAX_NAME:
        raise ValueError(f"{what}: a name has at most {MAX_NAME} characters, this one {len(value)}")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError(f"{what}: a name must not hold a control character (a line break, a NUL...)")
    return value


def output_run(output: str) -> str:
    """The run an enriched output is when nothing else names it: its absolute location (a local
    path made absolute, ``file://`` dropped so both spellings agree; a URL without its query)."""
    local = local_path(output)
    return absolute_location(local) if local is not None else bare_url(output)


def folder_run(runs_name: str | None, folder: str, output: str) -> str:
    """The run of one run folder under ``enrich-runs``: ``<runs_name>/<folder>`` when the runs
    root's runs are named (the same ids wherever the root is moved), else its output's location."""
    return f"{runs_name}/{folder}" if runs_name else output_run(output)


def runs_project(runs_root: str) -> str:
    """The project a runs root's scheduled runs land in unless one is named: the root folder's own
    name (``/data/nemo-runs`` -> ``nemo-runs``; ``s3://bucket`` -> ``bucket``)."""
    local = local_path(runs_root)
    if local is not None:
        name = os.path.basename(os.path.abspath(local).rstrip(os.sep))
    else:
        parts = urlsplit(bare_url(runs_root))
        name = parts.path.rstrip("/").rpartition("/")[2] or parts.netloc
    return name or DEFAULT_PROJECT
