"""The docs: the site builds strictly, the README stays short and true, docstring examples run."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CLI = Path(sys.executable).parent / "rollout-capture"

# Modules whose public flows and tasks must each carry a runnable example.
EXAMPLE_MODULES = [
    "rollout_capture.flows.enrich",
    "rollout_capture.flows.dispatch",
    "rollout_capture.flows.enrich_runs",
    "rollout_capture.flows.run_batch",
    "rollout_capture.flows.follow",
    "rollout_capture.flows.compact",
    "rollout_capture.tasks.capture",
    "rollout_capture.tasks.rollout_files",
    "rollout_capture.tasks.run_folders",
    "rollout_capture.tasks.retry",
    "rollout_capture.tasks.credentials",
]
# Started only by enrich_completed_runs and follow_run (they need the lease these took): their
# examples cover them.
INTERNAL = {"enrich_runs_batch", "publish_followed_run"}


def test_mkdocs_builds_strictly_with_the_api_reference(tmp_path: Path) -> None:
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr
    # The API reference was generated from the docstrings, not left as a bare directive.
    flows = (site / "api" / "flows" / "index.html").read_text()
    assert 'id="rollout_capture.flows.enrich_rollouts"' in flows
    assert "Enrich the bundled sample" in flows  # enrich_rollouts' example
    core = (site / "api" / "core" / "index.html").read_text()
    assert 'id="rollout_capture.CaptureStore"' in core
    contract = (site / "contract" / "index.html").read_text()
    assert "Extensions and interpretations" in contract


def test_readme_is_at_most_8_kib() -> None:
    assert README.stat().st_size <= 8192, f"README.md is {README.stat().st_size} bytes"


def test_readme_does_not_point_outside_the_repository() -> None:
    text = README.read_text()
    assert "../shared" not in text
    assert "shared/spec" not in text


def test_readme_links_lead_to_files_of_the_repository() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in local)
    missing = [
        link
        for link in local
        if not (ROOT / link).resolve().is_relative_to(ROOT) or not (ROOT / link).exists()
    ]
    assert not missing, f"README links to files that are not in the repository: {missing}"


def _commands_named(markdown: str) -> set[str]:
    """The ``rollout-capture <command>`` invocations in the README's code (blocks and spans).

    A line of code counts when ``rollout-capture`` is its program: the first word after any
    ``VAR=value`` assignments, comments dropped (``--pool rollout-capture`` is no command).
    """
    fenced = re.findall(r"^>? ?```[^\n]*\n(.*?)^>? ?```", markdown, flags=re.S | re.M)
    prose = re.sub(r"^>? ?```[^\n]*\n.*?^>? ?```", "", markdown, flags=re.S | re.M)
    lines = [line for block in fenced for line in block.splitlines()]
    lines += re.findall(r"`([^`\n]+)`", prose)
    named = set()
    for line in lines:
        words = line.lstrip("> ").split(" #", 1)[0].split()
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
            words.pop(0)
        if len(words) >= 2 and words[0] == "rollout-capture" and re.fullmatch(r"[a-z][a-z-]*", words[1]):
            named.add(words[1])
    return named


def _cli_commands() -> set[str]:
    done = subprocess.run(
        [str(CLI), "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"},
    )
    assert done.returncode == 0, done.stderr
    commands = done.stdout.split("Commands", 1)[1]
    return set(re.findall(r"^\W*([a-z][a-z-]*)\s", commands, flags=re.M))


def test_every_command_the_readme_names_exists() -> None:
    named = _commands_named(README.read_text())
    assert {"demo", "enrich", "deploy"} <= named, named
    missing = named - _cli_commands()
    assert not missing, f"README names commands the CLI does not have: {sorted(missing)}"


def _public_flows_and_tasks() -> list[tuple[str, Any]]:
    """Every flow and task defined in those modules, and the plain helpers the tasks export."""
    from prefect import Flow, Task

    import rollout_capture.tasks

    helpers = {*rollout_capture.tasks.__all__, "credentials_from_block"}
    found = []
    for name in EXAMPLE_MODULES:
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if attr.startswith("_") or attr in INTERNAL:
                continue
            inner = getattr(value, "fn", value)
            if getattr(inner, "__module__", None) != name:
                continue  # imported from elsewhere
            if isinstance(value, Flow | Task) or (attr in helpers and inspect.isfunction(value)):
                found.append((f"{name}.{attr}", inner))
    return found


def _examples(function: Any) -> list[str]:
    doc = inspect.getdoc(function) or ""
    section = doc.split("Examples:", 1)[1] if "Examples:" in doc else ""
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return [inspect.cleandoc("\n" + block) for block in blocks]


def test_every_public_flow_and_task_has_an_example() -> None:
    functions = _public_flows_and_tasks()
    assert len(functions) >= 15
    missing = [name for name, function in functions if not _examples(function)]
    assert not missing, f"no runnable example (an Examples: section with a python block): {missing}"


def test_docstring_examples_run(
    prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the examples' temporary folders
    for name, function in _public_flows_and_tasks():
        for example in _examples(function):
            exec(compile(example, f"<example of {name}>", "exec"), {"__name__": "__example__"})
            printed = capsys.readouterr().out
            assert printed.strip(), f"the example of {name} printed nothing"


def _changelog_sections() -> dict[str, str]:
    """The CHANGELOG's text under each ``## [version]`` heading."""
    text = (ROOT / "CHANGELOG.md").read_text()
    parts = re.split(r"^## \[([^\]]+)\]\s*$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_the_changelog_lists_a_command_under_the_release_that_added_it_alone() -> None:
    """A command added since the last release (``rollout-capture NAME`` under Unreleased) is not also
    in a released version's list: ``finish`` was in both."""
    sections = _changelog_sections()
    unreleased = sections.pop("Unreleased")
    added = unreleased.split("### Added", 1)[1].split("\n### ", 1)[0]
    new_commands = set(re.findall(r"`rollout-capture ([a-z-]+)", added))
    assert "finish" in new_commands, new_commands
    for version, text in sections.items():
        named = set(re.findall(r"`([a-z-]+)`", text))
        assert not new_commands & named, f"{version} lists commands Unreleased adds: {new_commands & named}"


def test_the_tiers_documented_differences_are_the_contracts_own() -> None:
    """Every difference tests/test_nemo_gym_070.py lets pass between NeMo Gym 0.7.0 and ours is
    one the contract names (issue 34), and the other way round: a difference added to one and not
    to the other fails here, so none goes undocumented."""
    from tests.support.nemo_gym_compare import DOCUMENTED_ATTACHMENT_KEYS, DOCUMENTED_CALL_FIELDS
    from tests.test_nemo_gym_070 import DOCUMENTED_PRODUCER_DIFFERENCES

    contract = (ROOT / "docs" / "contract.md").read_text()
    beside = contract.split("- **Our producers beside NeMo Gym's.**", 1)[1].split("\n## ", 1)[0]
    labels = re.findall(r"^  - `([^`]+)`:", beside, re.MULTILINE)
    assert labels == list(DOCUMENTED_PRODUCER_DIFFERENCES)
    allowed = contract.split("The differences allowed, each named here:", 1)[1].split("\n\n", 1)[0]
    record, attachment = allowed.split("in an attachment,", 1)
    assert set(re.findall(r"`([a-z_]+)`", record)) == DOCUMENTED_CALL_FIELDS
    assert set(re.findall(r"`([a-z_]+)`", attachment)) == DOCUMENTED_ATTACHMENT_KEYS


def test_what_we_create_stays_below_the_clients_single_request_uploads() -> None:
    """docs/stores.md says what the put-if-absent proof cannot tell: the clients switch to a
    multi-request upload above a size (s3fs 100 MiB, gcsfs 50 MiB, azure-storage-blob above 64 MiB)
    the proof never sends, and what we create stays far below. Pinned here, so a client changing
    its threshold, or our limits growing, shows."""

    import gcsfs
    import s3fs
    from azure.storage.blob import BlobServiceClient

    from rollout_capture.journal import MAX_COMMIT_BYTES
    from rollout_capture.producer.settings import DEFAULT_MAX_BODY_BYTES

    mib = 1 << 20
    s3_single = 2 * inspect.signature(s3fs.S3FileSystem._pipe_file).parameters["chunksize"].default
    gcs_single = inspect.signature(gcsfs.GCSFileSystem._pipe_file).parameters["chunksize"].default
    azure_single = BlobServiceClient("http://127.0.0.1:9/devstoreaccount1")._config.max_single_put_size
    assert (s3_single, gcs_single, azure_single) == (100 * mib, 50 * mib, 64 * mib)
    assert (8 * mib, 16 * mib) == (MAX_COMMIT_BYTES, DEFAULT_MAX_BODY_BYTES)
    assert min(s3_single, gcs_single, azure_single) > 2 * DEFAULT_MAX_BODY_BYTES
    text = (ROOT / "docs" / "stores.md").read_text()
    for said in (
        "s3fs from 100 MiB",
        "gcsfs from 50 MiB",
        "above 64 MiB",
        "at most 8 MiB",
        "16 MiB by default",
    ):
        assert said in text
